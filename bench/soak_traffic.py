"""Mixed client traffic against a live `omnistage serve tiny-llm tiny-image` (and tiny-omni for
realtime): streamed chat, images, jobs and spoken realtime answers from threads, every request's
outcome recorded (what `omnistage bench soak` and tests/reliability judge). Real HTTP through
httpx, SSE parsed line by line; realtime through a websockets client."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import httpx
from websockets.exceptions import WebSocketException
from websockets.sync.client import connect

CHAT = {"model": "tiny-llm", "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 12}
IMAGE = {"model": "tiny-image", "prompt": "a red square", "size": "64x64", "response_format": "b64_json"}
JOB = {
    "model": "tiny-image",
    "inputs": {"prompt": "a blue ball"},
    "params": {"denoiser": {"width": 64, "height": 64, "num_inference_steps": 4}},
}
REALTIME_MODEL = "tiny-omni"
PIPELINE_OF = {"chat": "tiny-llm", "image": "tiny-image", "job": "tiny-image", "realtime": REALTIME_MODEL}


@dataclass
class Outcome:
    kind: str  # chat | image | job | realtime
    start: float  # time.monotonic()
    end: float
    ok: bool
    status: int  # HTTP status of the response (200 for a stream that failed in-band)
    code: str | None = None  # error code (OpenAI-style body, in-band SSE error, or the job's error)
    retry_after: str | None = None

    @property
    def pipeline(self) -> str:
        return PIPELINE_OF[self.kind]

    @property
    def seconds(self) -> float:
        return self.end - self.start


def _error_of(response: httpx.Response) -> tuple[str | None, str | None]:
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    return code, response.headers.get("retry-after")


def sse_lines(response: httpx.Response):
    """The stream's lines split at \n only (httpx's iter_lines also splits at U+2028 and
    other Unicode line breaks, which a generated token may hold inside a JSON string)."""
    buffer = ""
    for text in response.iter_text():
        buffer += text
        *lines, buffer = buffer.split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if buffer:
        yield buffer


def chat(client: httpx.Client) -> Outcome:
    t0 = time.monotonic()
    with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        if r.status_code != 200:
            r.read()
            code, retry = _error_of(r)
            return Outcome("chat", t0, time.monotonic(), False, r.status_code, code, retry)
        done, code, data = False, None, []
        for line in sse_lines(r):
            if line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
                continue
            if line or not data:
                continue
            # an event ends at a blank line; a text with newlines spans several data: lines
            payload, data = "\n".join(data), []
            if payload == "[DONE]":
                done = True
            else:
                event = json.loads(payload)
                if "error" in event:
                    code = event["error"].get("code") or "unknown"
    return Outcome("chat", t0, time.monotonic(), done and code is None, 200, code)


def image(client: httpx.Client) -> Outcome:
    t0 = time.monotonic()
    r = client.post("/v1/images/generations", json=IMAGE)
    ok = r.status_code == 200 and bool(r.json()["data"][0]["b64_json"])
    code, retry = (None, None) if ok else _error_of(r)
    return Outcome("image", t0, time.monotonic(), ok, r.status_code, code, retry)


def job(client: httpx.Client) -> Outcome:
    t0 = time.monotonic()
    r = client.post("/v1/jobs", json=JOB)
    if r.status_code not in (200, 201, 202):
        code, retry = _error_of(r)
        return Outcome("job", t0, time.monotonic(), False, r.status_code, code, retry)
    job_id = r.json()["id"]
    while True:
        state = client.get(f"/v1/jobs/{job_id}").json()
        if state["status"] in ("completed", "failed", "cancelled", "expired"):
            break
        time.sleep(0.1)
    error = state.get("error") or {}
    code = error.get("code") if isinstance(error, dict) else str(error)
    return Outcome("job", t0, time.monotonic(), state["status"] == "completed", 200, code)


def realtime(client: httpx.Client) -> Outcome:
    """One realtime session: a typed question, one spoken answer of at most 8 tokens, closed.
    The status is 101 (the websocket upgrade); `code` is the failed response's error code, or
    that of an `error` event that refused the question."""
    url = str(client.base_url).replace("http", "ws", 1).rstrip("/") + f"/v1/realtime?model={REALTIME_MODEL}"
    t0 = time.monotonic()
    with connect(url, max_size=None, open_timeout=60) as ws:
        _until(ws, "session.created")
        update = {"type": "realtime", "audio": {"input": {"turn_detection": None}}}
        ws.send(json.dumps({"type": "session.update", "session": update}))
        _until(ws, "session.updated")
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello there"}]}
        ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 8}}))
        event = _until(ws, "response.done")
    if event["type"] == "error":
        return Outcome("realtime", t0, time.monotonic(), False, 101, event["error"].get("code") or "error")
    response = event["response"]
    details = response.get("status_details") or {}
    ok = response["status"] == "completed" or details.get("reason") == "max_output_tokens"
    code = None if ok else ((details.get("error") or {}).get("code") or response["status"])
    return Outcome("realtime", t0, time.monotonic(), ok, 101, code)


def _until(ws, kind: str, timeout: float = 120) -> dict:
    """The next event of type `kind`, or an `error` event that came first."""
    end = time.monotonic() + timeout
    while True:
        event = json.loads(ws.recv(timeout=max(0.1, end - time.monotonic())))
        if event["type"] in (kind, "error"):
            return event


KINDS = {"chat": chat, "image": image, "job": job, "realtime": realtime}


class Traffic:
    """Closed-loop clients (`clients` per kind, each sending its next request when the last
    one ended, after `think_s`: seconds, or seconds per kind) until `stop()`."""

    def __init__(self, url: str, clients: dict[str, int], think_s: float | dict[str, float] = 0.0):
        self.url = url
        self.outcomes: list[Outcome] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._think = think_s
        self._threads = [
            threading.Thread(target=self._client, args=(kind,), daemon=True)
            for kind, n in clients.items()
            for _ in range(n)
        ]

    def start(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def _client(self, kind: str) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self._stop.is_set():
                try:
                    outcome = KINDS[kind](client)
                except (httpx.HTTPError, WebSocketException, TimeoutError, ValueError, KeyError) as exc:  # a finding
                    with self._lock:
                        self.errors.append(exc)
                    continue
                with self._lock:
                    self.outcomes.append(outcome)
                think = self._think.get(kind, 0.0) if isinstance(self._think, dict) else self._think
                if think:
                    self._stop.wait(think)

    def stop(self, timeout: float = 120) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
        return list(self.outcomes)


def p99(values: list[float]) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
