// Tab 2: an image or video job through /v1/jobs, its progress from the job's events, its
// previews, and the result. A video plays while the VAE decodes it when the browser takes
// fragmented MP4 through Media Source Extensions; otherwise it plays once the job is done.
import { deletePath, followEvents, getBlob, getJson, openSocket, postJson, readStream } from "./api.js";

const FINISHED = new Set(["completed", "failed", "canceled"]);

// What the page did, for people and for tests (tests/browser reads it).
export const jobsState = {
  jobId: null,
  kind: null, // "image" | "video"
  status: "idle",
  percent: 0,
  events: [], // event types in arrival order
  progressEvents: 0,
  previews: 0,
  segments: 0, // pieces of the fMP4 stream received (websocket frames or HTTP chunks)
  videoTransport: null, // "websocket" | "http": where the video's events and bytes came from
  bytesAppended: 0, // of those, bytes the SourceBuffer took
  streamed: false, // the video played from the stream (MSE), not from the finished file
  streamEnded: false, // every received piece went into the SourceBuffer and the stream was closed
  imageUrl: null,
  imageSize: null, // [naturalWidth, naturalHeight] once the image has loaded
  videoUrl: null,
  error: null,
};

const $ = (id) => document.getElementById(id);
const pipelines = new Map(); // name -> "image" | "video"
let controller = null;

export async function setupJobs() {
  $("job-form").addEventListener("submit", (event) => {
    event.preventDefault();
    submit().catch(fail);
  });
  $("job-cancel").addEventListener("click", () => {
    if (jobsState.jobId) deletePath(`/v1/jobs/${jobsState.jobId}`).catch(fail);
  });
  $("job-model").addEventListener("change", showKindFields);
  const select = $("job-model");
  const listing = await getJson("/v1/pipelines");
  for (const card of listing.data) {
    const prompt = card.inputs && card.inputs.prompt && card.inputs.prompt.type === "text";
    const types = Object.values(card.outputs || {}).map((o) => o.type);
    const kind = types.includes("video") ? "video" : types.includes("image") ? "image" : null;
    if (!prompt || !kind) continue;
    pipelines.set(card.id, kind);
    select.append(new Option(`${card.id} (${kind})`, card.id));
  }
  if (!pipelines.size) select.append(new Option("no image or video pipeline hosted", ""));
  showKindFields();
}

function showKindFields() {
  const kind = pipelines.get($("job-model").value);
  for (const el of document.querySelectorAll(".video-only")) el.hidden = kind !== "video";
}

function setStatus(text) {
  jobsState.status = text;
  $("job-status").textContent = text;
}

function fail(error) {
  if (error.name === "AbortError") return; // a newer job replaced the one being followed
  jobsState.error = String(error.message || error);
  setStatus(`error: ${jobsState.error}`);
  $("job-submit").disabled = false;
  $("job-cancel").disabled = true;
}

function number(id) {
  return Number($(id).value);
}

function resetView(kind) {
  if (controller) controller.abort();
  controller = new AbortController();
  Object.assign(jobsState, {
    kind, percent: 0, events: [], progressEvents: 0, previews: 0, segments: 0, bytesAppended: 0, videoTransport: null,
    streamed: false, streamEnded: false, imageUrl: null, imageSize: null, videoUrl: null, error: null,
  });
  $("job-progress").value = 0;
  $("job-previews").replaceChildren();
  for (const el of [$("job-image"), $("job-video")]) {
    el.hidden = true;
    el.removeAttribute("src");
  }
}

async function submit() {
  const model = $("job-model").value;
  const kind = pipelines.get(model);
  if (!kind) throw new Error("choose a pipeline");
  resetView(kind);
  const denoiser = {
    width: number("job-width"),
    height: number("job-height"),
    num_inference_steps: number("job-steps"),
    seed: number("job-seed"),
  };
  if (kind === "video") denoiser.num_frames = number("job-frames");
  $("job-submit").disabled = true;
  setStatus("submitting");
  const job = await postJson("/v1/jobs", { model, inputs: { prompt: $("job-prompt").value }, params: { denoiser } });
  jobsState.jobId = job.id;
  $("job-cancel").disabled = false;
  setStatus(`${job.status} (${job.id})`);
  if (kind === "video") await followVideo(job.id);
  else await followEvents(`/v1/jobs/${job.id}/events`, onEvent, controller.signal);
}

function onEvent(event) {
  jobsState.events.push(event.type);
  if (event.type === "progress") {
    jobsState.progressEvents++;
    jobsState.percent = event.percent;
    $("job-progress").value = event.percent;
    setStatus(`${event.stage || "running"}: step ${event.done} of ${event.total}`);
  } else if (event.type === "preview") {
    jobsState.previews++;
    const item = document.createElement("li");
    item.textContent = `${event.port}: chunk ${event.chunk + 1} produced`;
    $("job-previews").append(item);
  } else if (event.type === "output") {
    showOutput(event.urls || []).catch(fail);
  } else if (event.type === "queued" || event.type === "started") {
    setStatus(`${event.type} (${event.job_id})`);
  }
  if (FINISHED.has(event.type)) {
    if (event.type === "completed") {
      jobsState.percent = 100;
      $("job-progress").value = 100;
    }
    const reason = event.error ? `: ${event.error.message}` : "";
    setStatus(event.type + reason);
    if (event.error) jobsState.error = event.error.message;
    $("job-submit").disabled = false;
    $("job-cancel").disabled = true;
  }
}

async function showOutput(urls) {
  const image = urls.find((u) => u.media_type.startsWith("image/"));
  if (image && jobsState.kind === "image") {
    // fetched with the key, then shown from memory: an <img src> cannot send a header
    const el = $("job-image");
    el.onload = () => (jobsState.imageSize = [el.naturalWidth, el.naturalHeight]);
    jobsState.imageUrl = image.url;
    el.src = URL.createObjectURL(await getBlob(image.url));
    el.hidden = false;
  }
  const video = urls.find((u) => u.media_type.startsWith("video/"));
  if (video && jobsState.kind === "video" && !jobsState.streamed) {
    jobsState.videoUrl = video.url;
    const el = $("job-video");
    el.src = URL.createObjectURL(await getBlob(video.url));
    el.hidden = false;
  }
}

// The H.264 profile and level from the init segment's avcC box, as MSE's codecs parameter.
function avcCodec(bytes) {
  for (let i = 4; i + 8 < bytes.length; i++) {
    if (bytes[i] === 0x61 && bytes[i + 1] === 0x76 && bytes[i + 2] === 0x63 && bytes[i + 3] === 0x43) {
      const hex = (b) => b.toString(16).padStart(2, "0");
      return `avc1.${hex(bytes[i + 5])}${hex(bytes[i + 6])}${hex(bytes[i + 7])}`;
    }
  }
  return null;
}

// Appends segments to a SourceBuffer one at a time (appendBuffer is asynchronous).
class StreamPlayer {
  constructor(video) {
    this.video = video;
    this.queue = [];
    this.buffer = null;
    this.ended = false;
  }

  static supported(codec) {
    return "MediaSource" in window && MediaSource.isTypeSupported(`video/mp4; codecs="${codec}"`);
  }

  start(codec) {
    const source = new MediaSource();
    this.source = source;
    this.video.src = URL.createObjectURL(source);
    this.video.hidden = false;
    source.addEventListener("sourceopen", () => {
      this.buffer = source.addSourceBuffer(`video/mp4; codecs="${codec}"`);
      this.buffer.addEventListener("updateend", () => this.pump());
      this.pump();
    });
  }

  push(bytes) {
    this.queue.push(bytes);
    this.pump();
  }

  end() {
    this.ended = true;
    this.pump();
  }

  pump() {
    if (!this.buffer || this.buffer.updating) return;
    const next = this.queue.shift();
    if (next) {
      this.buffer.appendBuffer(next);
      jobsState.bytesAppended += next.byteLength;
      if (this.video.paused) this.video.play().catch(() => {});
    } else if (this.ended && this.source.readyState === "open") {
      this.source.endOfStream();
      jobsState.streamEnded = true;
    }
  }
}

// The video's bytes, in pieces, to MSE once the init segment names the codec.
class VideoSink {
  constructor() {
    this.player = null;
    this.head = []; // pieces before the codec is known
  }

  push(bytes) {
    jobsState.segments++;
    if (this.player) return this.player.push(bytes);
    if (this.head === null) return; // MSE cannot play it: the finished file will be shown
    this.head.push(bytes);
    const joined = new Uint8Array(this.head.reduce((n, b) => n + b.byteLength, 0));
    let at = 0;
    for (const b of this.head) joined.set(b, (at += b.byteLength) - b.byteLength);
    const codec = avcCodec(joined);
    if (!codec) return;
    if (StreamPlayer.supported(codec)) {
      this.player = new StreamPlayer($("job-video"));
      this.player.start(codec);
      jobsState.streamed = true;
      this.player.push(joined);
    }
    this.head = null;
  }

  end() {
    if (this.player) this.player.end();
  }
}

// WS /v1/jobs/{id}/stream: the job's events as text frames, the video as binary fMP4 segments.
function followVideo(jobId) {
  return new Promise((resolve, reject) => {
    const socket = openSocket(`/v1/jobs/${jobId}/stream`);
    socket.binaryType = "arraybuffer";
    const sink = new VideoSink();
    let opened = false;
    socket.onopen = () => {
      opened = true;
      jobsState.videoTransport = "websocket";
    };
    socket.onmessage = (message) => {
      if (typeof message.data !== "string") return sink.push(new Uint8Array(message.data));
      const event = JSON.parse(message.data);
      onEvent(event);
      if (event.type === "completed") sink.end();
    };
    socket.onclose = () => (opened ? resolve() : followVideoOverHttp(jobId).then(resolve, reject));
    controller.signal.addEventListener("abort", () => socket.close());
  });
}

// The same over HTTP: SSE for the events, the chunked GET /v1/jobs/{id}/stream for the bytes.
async function followVideoOverHttp(jobId) {
  jobsState.videoTransport = "http";
  const sink = new VideoSink();
  const events = followEvents(`/v1/jobs/${jobId}/events`, onEvent, controller.signal);
  const reader = await readStream(`/v1/jobs/${jobId}/stream`, controller.signal);
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    sink.push(value);
  }
  sink.end();
  await events;
}
