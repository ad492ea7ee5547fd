"""Server VAD: silero-vad over 32 ms frames at 16 kHz, batched across every session of the
process, and the turn detector that turns its speech probabilities into speech started /
stopped.

The model is silero's ONNX export (the package ships it) in one onnxruntime session, loaded
once: at one frame per forward it costs about a third of the TorchScript module's CPU time
(0.16 against 0.5 ms here), and with 16 microphones most forwards carry one or two frames. Its
recurrent state and its 64-sample left context are kept per session (`VadStream`), so one
forward can carry one frame of every session that has audio waiting. `VadBatcher` collects
those frames from the event loop and runs the forwards on one thread of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from dataclasses import dataclass, field

import numpy as np

from omnistage.serving.realtime.audio import SESSION_RATE, StreamResampler

VAD_RATE = 16_000
FRAME = 512  # samples per silero frame at 16 kHz (32 ms)
FRAME_MS = FRAME * 1000 // VAD_RATE
CONTEXT = 64  # left context silero prepends to each frame
STATE_SHAPE = (2, 1, 128)
HYSTERESIS = 0.15  # speech continues while the probability stays above threshold - this


class _Model:
    """The silero network (an onnxruntime session on one thread); loaded on first use, shared
    by every session."""

    _lock = threading.Lock()
    _session = None
    SAMPLE_RATE = np.array(VAD_RATE, dtype=np.int64)

    @classmethod
    def get(cls):
        with cls._lock:
            if cls._session is None:
                from silero_vad import load_silero_vad

                cls._session = load_silero_vad(onnx=True).session
            return cls._session

    @classmethod
    def forward(cls, x: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Frames with their left context [n, CONTEXT + FRAME] and states [2, n, 128] ->
        speech probabilities [n] and the new states."""
        out, new_state = cls.get().run(None, {"input": x, "state": state, "sr": cls.SAMPLE_RATE})
        return out.reshape(-1), new_state


@dataclass
class VadStream:
    """One session's silero state, its resampler to 16 kHz, and its audio not yet cut into
    whole frames."""

    state: np.ndarray = field(default_factory=lambda: np.zeros(STATE_SHAPE, dtype=np.float32))
    context: np.ndarray = field(default_factory=lambda: np.zeros(CONTEXT, dtype=np.float32))
    resampler: StreamResampler = field(default_factory=lambda: StreamResampler(SESSION_RATE, VAD_RATE))
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))

    def frames(self, samples: np.ndarray) -> np.ndarray:
        """Session-rate samples in -> whole 16 kHz frames [n, FRAME] (the rest waits)."""
        self.pending = np.concatenate([self.pending, self.resampler.push(samples)])
        n = len(self.pending) // FRAME
        block, self.pending = self.pending[: n * FRAME], self.pending[n * FRAME :]
        return block.reshape(n, FRAME)


def run_samples(jobs: list[tuple[VadStream, np.ndarray]]) -> list[np.ndarray]:
    """Cuts each job's new samples into frames (off the event loop), then runs them."""
    return run_frames([(stream, stream.frames(samples)) for stream, samples in jobs])


def run_frames(jobs: list[tuple[VadStream, np.ndarray]]) -> list[np.ndarray]:
    """Speech probabilities of each job's frames: round k runs the k-th frame of every job
    that has one in one batched forward."""
    probs = [np.zeros(len(frames), dtype=np.float32) for _, frames in jobs]
    rounds = max((len(frames) for _, frames in jobs), default=0)
    for k in range(rounds):
        rows = [i for i, (_, frames) in enumerate(jobs) if len(frames) > k]
        x = np.stack([np.concatenate([jobs[i][0].context, jobs[i][1][k]]) for i in rows])
        state = np.concatenate([jobs[i][0].state for i in rows], axis=1)
        out, new_state = _Model.forward(x, state)
        for j, i in enumerate(rows):
            stream = jobs[i][0]
            stream.state = new_state[:, j : j + 1].copy()
            stream.context = jobs[i][1][k][-CONTEXT:].copy()
            probs[i][k] = out[j]
    return probs


class VadBatcher:
    """Collects frames from every session on the loop and answers each with its probabilities."""

    def __init__(self) -> None:
        self._queue: list[tuple[VadStream, np.ndarray, asyncio.Future]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="omnistage-vad")

    def preload(self) -> None:
        """Starts loading the model (seconds) on the VAD thread, so a session's first frames need not wait."""
        self._pool.submit(_Model.get)

    async def probabilities(self, stream: VadStream, samples: np.ndarray) -> np.ndarray:
        """Speech probability of each whole 32 ms frame that `samples` (24 kHz) completes."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._serve())
        future = loop.create_future()
        self._queue.append((stream, samples, future))
        self._wake.set()
        return await future

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            jobs, self._queue = self._queue, []
            if not jobs:
                continue
            try:
                probs = await loop.run_in_executor(self._pool, run_samples, [(s, f) for s, f, _ in jobs])
            except Exception as exc:  # noqa: BLE001 - every waiting session hears of it
                for _, _, fut in jobs:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, _, fut), p in zip(jobs, probs):
                if not fut.done():
                    fut.set_result(p)


@dataclass(frozen=True)
class VadSettings:
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500


@dataclass
class TurnEvent:
    kind: str  # "started" | "paused" | "resumed" | "stopped"
    # started: audio_start_ms (prefix padding included); paused, stopped: where the silence
    # began (a stop's audio_end_ms); resumed: the frame that broke the silence. Input clock.
    ms: int


@dataclass
class TurnDetector:
    """Speech start when a frame's probability reaches the threshold; stop after
    `silence_duration_ms` of frames below threshold - HYSTERESIS. Within speech, `pause_ms` of
    such frames make a pause (the turn may end there: a preemptive response starts), and a
    frame above it after a pause resumes the speech. None: no pauses reported."""

    settings: VadSettings
    pause_ms: int | None = None
    speaking: bool = False
    frames_seen: int = 0
    silence_ms: int = 0

    @property
    def _pause_at(self) -> int:
        """Silence (ms, whole frames) that makes a pause; 0: none."""
        if self.pause_ms is None:
            return 0
        return max(FRAME_MS, -(-self.pause_ms // FRAME_MS) * FRAME_MS)

    def feed(self, probs: np.ndarray, offset_ms: int = 0) -> list[TurnEvent]:
        events: list[TurnEvent] = []
        s = self.settings
        for p in probs:
            start_ms = offset_ms + self.frames_seen * FRAME_MS
            self.frames_seen += 1
            if not self.speaking:
                if p >= s.threshold:
                    self.speaking, self.silence_ms = True, 0
                    events.append(TurnEvent("started", max(0, start_ms - s.prefix_padding_ms)))
                continue
            if p >= s.threshold - HYSTERESIS:
                if self._pause_at and self.silence_ms >= self._pause_at:
                    events.append(TurnEvent("resumed", start_ms))
                self.silence_ms = 0
                continue
            self.silence_ms += FRAME_MS
            if self.silence_ms == self._pause_at:
                events.append(TurnEvent("paused", start_ms + FRAME_MS - self.silence_ms))
            if self.silence_ms >= s.silence_duration_ms:
                self.speaking = False
                events.append(TurnEvent("stopped", start_ms + FRAME_MS - self.silence_ms))
        return events
