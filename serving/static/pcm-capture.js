// AudioWorklet processor: the microphone's first channel, resampled from the context's rate
// to 24 kHz and converted to 16-bit PCM, posted to the page in 20 ms frames (480 samples).
const TARGET_RATE = 24000;
const FRAME_SAMPLES = 480;

class PcmCapture extends AudioWorkletProcessor {
  constructor() {
    super();
    this.step = sampleRate / TARGET_RATE; // input samples per output sample
    this.pos = 0; // where the next output sample falls, in input samples from this block's start
    this.prev = 0; // the previous block's last (smoothed) sample, for interpolation across blocks
    // A moving average over one output period keeps what lies above 12 kHz from folding back.
    this.width = Math.max(1, Math.round(this.step));
    this.history = new Float32Array(this.width);
    this.historyAt = 0;
    this.historySum = 0;
    this.frame = new Int16Array(FRAME_SAMPLES);
    this.filled = 0;
  }

  smooth(channel) {
    const out = new Float32Array(channel.length);
    for (let i = 0; i < channel.length; i++) {
      this.historySum += channel[i] - this.history[this.historyAt];
      this.history[this.historyAt] = channel[i];
      this.historyAt = (this.historyAt + 1) % this.width;
      out[i] = this.historySum / this.width;
    }
    return out;
  }

  emit(value) {
    const clipped = Math.max(-1, Math.min(1, value));
    this.frame[this.filled++] = clipped < 0 ? clipped * 0x8000 : clipped * 0x7fff;
    if (this.filled === FRAME_SAMPLES) {
      this.port.postMessage(this.frame.buffer, [this.frame.buffer]);
      this.frame = new Int16Array(FRAME_SAMPLES);
      this.filled = 0;
    }
  }

  process(inputs) {
    const input = inputs[0];
    if (!input || input.length === 0) return true;
    const x = this.smooth(input[0]);
    const n = x.length;
    // Output sample k sits at input position pos; -1 is the previous block's last sample.
    while (this.pos < n - 1) {
      const i = Math.floor(this.pos);
      const f = this.pos - i;
      const a = i < 0 ? this.prev : x[i];
      this.emit(a + (x[i + 1] - a) * f);
      this.pos += this.step;
    }
    this.pos -= n;
    this.prev = x[n - 1];
    return true;
  }
}

registerProcessor("pcm-capture", PcmCapture);
