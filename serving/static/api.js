// The server's HTTP and websocket routes as the page uses them, with the API key (if any).

const KEY_STORAGE = "omnistage-api-key";

export function apiKey() {
  return document.getElementById("api-key").value.trim();
}

export function rememberKey() {
  const input = document.getElementById("api-key");
  input.value = localStorage.getItem(KEY_STORAGE) || "";
  input.addEventListener("change", () => localStorage.setItem(KEY_STORAGE, input.value.trim()));
}

function headers(extra = {}) {
  const key = apiKey();
  return key ? { Authorization: `Bearer ${key}`, ...extra } : extra;
}

// The server's errors are OpenAI-shaped: {"error": {"message", "type", "param", "code"}}.
async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (_) {
    // not JSON: the status line says enough
  }
  return new Error(message);
}

export async function getJson(path) {
  const response = await fetch(path, { headers: headers() });
  if (!response.ok) throw await failure(response);
  return response.json();
}

export async function postJson(path, body) {
  const response = await fetch(path, {
    method: "POST",
    headers: headers({ "content-type": "application/json" }),
    body: JSON.stringify(body),
  });
  if (!response.ok) throw await failure(response);
  return response.json();
}

export async function deletePath(path) {
  const response = await fetch(path, { method: "DELETE", headers: headers() });
  if (!response.ok) throw await failure(response);
  return response.json();
}

export async function getBlob(path) {
  const response = await fetch(path, { headers: headers() });
  if (!response.ok) throw await failure(response);
  return response.blob();
}

// A response body as it arrives (a reader of Uint8Array chunks).
export async function readStream(path, signal) {
  const response = await fetch(path, { headers: headers(), signal });
  if (!response.ok) throw await failure(response);
  return response.body.getReader();
}

// Server-sent events read through fetch (EventSource cannot send an Authorization header).
export async function followEvents(path, onEvent, signal) {
  const response = await fetch(path, { headers: headers({ accept: "text/event-stream" }), signal });
  if (!response.ok) throw await failure(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) onEvent(JSON.parse(data));
    }
  }
}

// A websocket URL on this server. A browser cannot set an Authorization header on a
// websocket, so a key travels as the subprotocol `openai-insecure-api-key.KEY` (what OpenAI's
// browser clients send; the realtime route answers with the `realtime` subprotocol) or, for
// routes that take no subprotocol, as `?api_key=KEY`.
export function openSocket(path, { keyAs = "query" } = {}) {
  const url = new URL(path, location.href);
  url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  const key = apiKey();
  if (key && keyAs === "subprotocol") return new WebSocket(url, ["realtime", `openai-insecure-api-key.${key}`]);
  if (key) url.searchParams.set("api_key", key);
  return new WebSocket(url);
}

export function base64FromBytes(bytes) {
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    binary += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  }
  return btoa(binary);
}

export function bytesFromBase64(text) {
  const binary = atob(text);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  return bytes;
}
