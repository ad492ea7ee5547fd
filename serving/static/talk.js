// Tab 1: a voice conversation over WS /v1/realtime (the OpenAI Realtime GA events).
// Microphone -> AudioWorklet (pcm-capture.js: 24 kHz pcm16, 20 ms frames) ->
// input_audio_buffer.append; the server's VAD finds the turns; response.output_audio.delta
// chunks go through a jitter buffer and play back to back on the AudioContext clock; speech
// that starts during playback stops it and truncates the answer to what was heard.
import { base64FromBytes, bytesFromBase64, openSocket } from "./api.js";

const RATE = 24000;
const PREBUFFER_S = 0.12; // audio held before a response starts playing, against network jitter
const LEAD_S = 0.02; // scheduling headroom ahead of the audio clock
const MAX_SCHEDULE_RECORDS = 10000;

// What the page did, for people and for tests (tests/browser reads it).
export const talkState = {
  status: "idle",
  session: null,
  framesSent: 0,
  bytesSent: 0,
  captureStartedAt: null, // AudioContext time of the first frame sent
  capturedUntil: null, // AudioContext time of the latest frame sent
  events: {}, // server event type -> count
  audioDeltas: 0,
  audioBytesReceived: 0,
  buffersScheduled: 0,
  secondsScheduled: 0,
  secondsScheduledByItem: {}, // assistant item id -> seconds of its audio scheduled
  schedule: [], // [item id, start on the audio clock, duration] of each chunk scheduled
  underruns: 0,
  receivedPeak: 0, // the loudest sample of the answers received (1: full scale)
  outputPeak: 0, // the loudest sample the meters saw leave for the speakers
  speechStarted: 0,
  truncatesSent: 0,
  truncations: [], // {item_id, audio_end_ms, scheduled_ms} of each conversation.item.truncate sent
  truncated: [], // the same, as the server's conversation.item.truncated confirms them
  responseStatuses: [], // each response.done's status: completed, cancelled, incomplete, ...
  responsesDone: 0,
  transcript: "", // the assistant's spoken words, every turn, from the deltas
  transcriptsDone: [], // each answer's whole transcript, as the server's *.done event states it
  errors: [],
};

const $ = (id) => document.getElementById(id);

// Chunks of one response's audio, scheduled back to back once PREBUFFER_S is queued.
export class Player {
  constructor(context) {
    this.context = context;
    // every chunk plays through one node, where an analyser measures what reaches the speakers
    this.output = context.createGain();
    this.output.connect(context.destination);
    this.analyser = context.createAnalyser();
    this.output.connect(this.analyser);
    this.probe = new Float32Array(this.analyser.fftSize);
    this.pending = []; // AudioBuffers not yet scheduled
    this.pendingSeconds = 0;
    this.playing = []; // {source, start, duration} of the current item, in order
    this.itemId = null;
    this.endAt = 0; // audio clock time the last scheduled chunk ends
    this.flushing = false; // the response is complete: play whatever is left at once
    this.starved = false; // an underrun was counted and playback waits for the prebuffer again
  }

  push(itemId, bytes) {
    if (itemId !== this.itemId) this.reset(itemId);
    const samples = new Int16Array(bytes.buffer, bytes.byteOffset, bytes.byteLength >> 1);
    const buffer = this.context.createBuffer(1, samples.length, RATE);
    const channel = buffer.getChannelData(0);
    let peak = talkState.receivedPeak;
    for (let i = 0; i < samples.length; i++) {
      channel[i] = samples[i] / 0x8000;
      peak = Math.max(peak, Math.abs(channel[i]));
    }
    talkState.receivedPeak = peak;
    this.pending.push(buffer);
    this.pendingSeconds += buffer.duration;
    this.schedule();
  }

  finish() {
    this.flushing = true;
    this.schedule();
  }

  schedule() {
    const now = this.context.currentTime;
    const running = this.endAt > now;
    if (!running && this.playing.length && this.pending.length && !this.starved) {
      talkState.underruns++; // the previous chunk has ended and the next was not there
      this.starved = true;
    }
    if (!running && !this.flushing && this.pendingSeconds < PREBUFFER_S) return;
    let at = running ? this.endAt : now + LEAD_S; // while one plays, the next joins it seamlessly
    for (const buffer of this.pending) {
      const source = this.context.createBufferSource();
      source.buffer = buffer;
      source.connect(this.output);
      source.start(at);
      this.playing.push({ source, start: at, duration: buffer.duration });
      if (talkState.schedule.length < MAX_SCHEDULE_RECORDS) talkState.schedule.push([this.itemId, at, buffer.duration]);
      at += buffer.duration;
      talkState.buffersScheduled++;
      talkState.secondsScheduled += buffer.duration;
      const byItem = talkState.secondsScheduledByItem;
      byItem[this.itemId] = (byItem[this.itemId] || 0) + buffer.duration;
    }
    this.endAt = at;
    this.starved = false;
    this.pending = [];
    this.pendingSeconds = 0;
  }

  // Milliseconds of the current item the listener has heard so far.
  playedMs() {
    const now = this.context.currentTime;
    let heard = 0;
    for (const chunk of this.playing) heard += Math.min(Math.max(now - chunk.start, 0), chunk.duration);
    return Math.floor(heard * 1000);
  }

  // The loudest sample of the last ~40 ms that went out to the speakers.
  outputLevel() {
    this.analyser.getFloatTimeDomainData(this.probe);
    let peak = 0;
    for (const v of this.probe) peak = Math.max(peak, Math.abs(v));
    talkState.outputPeak = Math.max(talkState.outputPeak, peak);
    return peak;
  }

  isAudible() {
    return this.pending.length > 0 || this.endAt > this.context.currentTime;
  }

  bufferedSeconds() {
    return Math.max(this.endAt - this.context.currentTime, 0) + this.pendingSeconds;
  }

  reset(itemId = null) {
    for (const chunk of this.playing) {
      try {
        chunk.source.stop();
      } catch (_) {
        // never started
      }
    }
    this.playing = [];
    this.pending = [];
    this.pendingSeconds = 0;
    this.endAt = 0;
    this.itemId = itemId;
    this.flushing = false;
    this.starved = false;
  }
}

class TalkSession {
  constructor(model) {
    this.model = model;
    this.context = null;
    this.stream = null;
    this.socket = null;
    this.player = null;
    this.playingResponse = null;
    this.answering = false; // between response.created and response.done
    this.dropResponse = null; // a response interrupted by the user: its late deltas are ignored
    this.turns = new Map(); // item id -> transcript <li>
  }

  async start() {
    if (!window.isSecureContext || !navigator.mediaDevices || !window.AudioWorkletNode) {
      throw new Error("the microphone needs a secure page: open it as http://localhost, http://127.0.0.1 or https://");
    }
    this.context = new AudioContext({ latencyHint: "interactive" });
    await this.context.resume(); // some browsers create it suspended until a gesture resumes it
    await this.context.audioWorklet.addModule("/static/pcm-capture.js");
    this.stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
    this.player = new Player(this.context);
    this.socket = openSocket(`/v1/realtime?model=${encodeURIComponent(this.model)}`, { keyAs: "subprotocol" });
    this.socket.onopen = () => this.configure();
    this.socket.onmessage = (message) => this.onServerEvent(JSON.parse(message.data));
    this.socket.onerror = () => setStatus("the realtime connection failed");
    this.socket.onclose = (event) => {
      setStatus(`closed${event.reason ? `: ${event.reason}` : ""}`);
      this.stop();
    };
    const microphone = this.context.createMediaStreamSource(this.stream);
    this.capture = new AudioWorkletNode(this.context, "pcm-capture");
    this.capture.port.onmessage = (message) => this.sendFrame(new Uint8Array(message.data));
    // A silent sink keeps the worklet in the rendering graph without playing the microphone.
    const sink = this.context.createGain();
    sink.gain.value = 0;
    microphone.connect(this.capture).connect(sink).connect(this.context.destination);
    this.meterTimer = setInterval(() => this.updateMeters(), 50);
  }

  configure() {
    const maxTokens = Number($("talk-max-tokens").value);
    this.send({
      type: "session.update",
      session: {
        type: "realtime",
        output_modalities: ["audio"],
        max_output_tokens: maxTokens >= 1 ? maxTokens : "inf", // "inf": the pipeline's own limit
        audio: {
          input: {
            format: { type: "audio/pcm", rate: RATE },
            turn_detection: { type: "server_vad", create_response: true, interrupt_response: true },
          },
          output: { format: { type: "audio/pcm", rate: RATE } },
        },
      },
    });
    setStatus("listening");
  }

  send(event) {
    if (this.socket && this.socket.readyState === WebSocket.OPEN) this.socket.send(JSON.stringify(event));
  }

  sendFrame(bytes) {
    if (!this.socket || this.socket.readyState !== WebSocket.OPEN) return;
    if (talkState.captureStartedAt === null) talkState.captureStartedAt = this.context.currentTime;
    talkState.capturedUntil = this.context.currentTime;
    let sum = 0;
    const samples = new Int16Array(bytes.buffer);
    for (const s of samples) sum += s * s;
    this.micLevel = Math.min(1, Math.sqrt(sum / samples.length) / 0x2000);
    this.send({ type: "input_audio_buffer.append", audio: base64FromBytes(bytes) });
    talkState.framesSent++;
    talkState.bytesSent += bytes.byteLength;
  }

  onServerEvent(event) {
    talkState.events[event.type] = (talkState.events[event.type] || 0) + 1;
    switch (event.type) {
      case "session.created":
      case "session.updated":
        talkState.session = event.session; // the configuration as the server applied it
        break;
      case "input_audio_buffer.speech_started":
        talkState.speechStarted++;
        this.interrupt();
        setStatus("hearing you");
        break;
      case "input_audio_buffer.speech_stopped":
        setStatus("thinking");
        break;
      case "conversation.item.added":
      case "conversation.item.created":
        if (event.item && event.item.role === "user") this.turn(event.item.id, "user", "(speech)");
        break;
      case "conversation.item.truncated":
        talkState.truncated.push({ item_id: event.item_id, audio_end_ms: event.audio_end_ms });
        break;
      case "conversation.item.input_audio_transcription.completed":
        this.turn(event.item_id, "user", "").textContent = event.transcript;
        break;
      case "response.created":
        this.answering = true;
        if (!this.player.isAudible()) this.player.reset(); // the last answer is over: not this one's audio

        setStatus("answering");
        break;
      case "response.output_audio.delta":
      case "response.audio.delta":
        if (event.response_id === this.dropResponse) break;
        talkState.audioDeltas++;
        this.playingResponse = event.response_id;
        this.onAudio(event.item_id, bytesFromBase64(event.delta));
        break;
      case "response.output_audio_transcript.delta":
      case "response.audio_transcript.delta":
      case "response.output_text.delta":
      case "response.text.delta":
        if (event.response_id === this.dropResponse) break;
        talkState.transcript += event.delta;
        this.turn(event.item_id, "assistant", "").textContent += event.delta;
        break;
      case "response.output_audio_transcript.done":
      case "response.audio_transcript.done":
        if (event.response_id !== this.dropResponse) talkState.transcriptsDone.push(event.transcript);
        break;
      case "response.output_text.done":
      case "response.text.done":
        if (event.response_id !== this.dropResponse) talkState.transcriptsDone.push(event.text);
        break;
      case "response.done":
        this.answering = false;
        talkState.responsesDone++;
        talkState.responseStatuses.push(event.response && event.response.status);
        if (this.player) this.player.finish();
        setStatus(`listening (last answer ${event.response && event.response.status})`);
        break;
      case "error":
        talkState.errors.push(event.error && event.error.message);
        setStatus(`error: ${event.error && event.error.message}`);
        break;
    }
  }

  onAudio(itemId, bytes) {
    talkState.audioBytesReceived += bytes.byteLength;
    this.player.push(itemId, bytes);
  }

  // The user spoke over the answer (still playing, or still coming): silence it now and tell
  // the server how much of it was heard.
  interrupt() {
    const player = this.player;
    if (!player || !player.itemId || !(this.answering || player.isAudible())) return;
    const heard = player.playedMs();
    this.send({ type: "conversation.item.truncate", item_id: player.itemId, content_index: 0, audio_end_ms: heard });
    talkState.truncatesSent++;
    const scheduledMs = (talkState.secondsScheduledByItem[player.itemId] || 0) * 1000;
    talkState.truncations.push({ item_id: player.itemId, audio_end_ms: heard, scheduled_ms: scheduledMs });
    const li = this.turns.get(player.itemId);
    if (li) li.classList.add("interrupted");
    this.dropResponse = this.playingResponse;
    player.reset();
  }

  turn(itemId, role, text) {
    let li = this.turns.get(itemId);
    if (!li) {
      li = document.createElement("li");
      li.className = role;
      li.textContent = text;
      this.turns.set(itemId, li);
      $("transcript").append(li);
    }
    return li;
  }

  updateMeters() {
    $("mic-level").value = this.micLevel || 0;
    $("play-level").value = this.player ? Math.min(this.player.bufferedSeconds() / 2, 1) : 0;
    if (this.player) $("out-level").value = this.player.outputLevel();
    const s = talkState;
    $("talk-counters").textContent =
      `sent ${(s.bytesSent / 2 / RATE).toFixed(1)} s · received ${s.audioDeltas} chunks ` +
      `(${(s.audioBytesReceived / 2 / RATE).toFixed(1)} s) · underruns ${s.underruns}`;
  }

  stop() {
    clearInterval(this.meterTimer);
    if (this.socket && this.socket.readyState <= WebSocket.OPEN) this.socket.close();
    if (this.stream) for (const track of this.stream.getTracks()) track.stop();
    if (this.player) this.player.reset();
    if (this.context && this.context.state !== "closed") this.context.close();
    this.socket = this.stream = this.context = null;
    $("talk-start").disabled = false;
    $("talk-stop").disabled = true;
  }
}

function setStatus(text) {
  talkState.status = text;
  $("talk-status").textContent = text;
}

let session = null;

export async function setupTalk(models) {
  const select = $("talk-model");
  // Pipelines that answer in speech: their chat family has audio among its output modalities.
  for (const card of models) {
    const audio = Object.values(card.modalities || {}).some((m) => JSON.stringify(m).includes("audio"));
    if (audio) select.append(new Option(card.id, card.id));
  }
  if (!select.options.length) select.append(new Option("no speech pipeline hosted", ""));
  $("talk-start").addEventListener("click", async () => {
    $("talk-start").disabled = true;
    $("talk-stop").disabled = false;
    session = new TalkSession(select.value);
    try {
      await session.start();
    } catch (error) {
      talkState.errors.push(String(error.message || error));
      setStatus(`error: ${error.message || error}`);
      session.stop();
    }
  });
  $("talk-stop").addEventListener("click", () => session && session.stop());
}
