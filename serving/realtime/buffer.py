"""The input audio buffer: what `input_audio_buffer.append` added since the last commit or
clear, on the session's input clock (milliseconds of audio appended since the session began)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from omnistage.serving.realtime.audio import SESSION_RATE

MAX_BUFFER_S = 300  # an uncommitted buffer past this is refused (the thinker hears 30 s per clip anyway)
MIN_COMMIT_MS = 100


@dataclass
class InputBuffer:
    chunks: list[np.ndarray] = field(default_factory=list)
    start_sample: int = 0  # input-clock position of the buffer's first sample
    total_samples: int = 0  # input clock: every sample appended this session

    @property
    def samples(self) -> int:
        return self.total_samples - self.start_sample

    @property
    def now_ms(self) -> int:
        return self.total_samples * 1000 // SESSION_RATE

    @property
    def start_ms(self) -> int:
        return self.start_sample * 1000 // SESSION_RATE

    def append(self, samples: np.ndarray) -> None:
        self.chunks.append(samples)
        self.total_samples += len(samples)

    def too_long(self) -> bool:
        return self.samples > MAX_BUFFER_S * SESSION_RATE

    def _span(self, start_ms: int | None, end_ms: int | None) -> tuple[np.ndarray, int, int]:
        audio = np.concatenate(self.chunks) if self.chunks else np.zeros(0, dtype=np.float32)
        lo = 0 if start_ms is None else max(0, start_ms * SESSION_RATE // 1000 - self.start_sample)
        hi = (
            len(audio)
            if end_ms is None
            else max(lo, min(len(audio), end_ms * SESSION_RATE // 1000 - self.start_sample))
        )
        return audio, lo, hi

    def peek(self, start_ms: int | None = None, end_ms: int | None = None) -> np.ndarray:
        """The audio `take` would return, left in the buffer."""
        audio, lo, hi = self._span(start_ms, end_ms)
        return audio[lo:hi]

    def take(self, start_ms: int | None = None, end_ms: int | None = None) -> np.ndarray:
        """The audio in [start_ms, end_ms) (default: all); the buffer then starts at end_ms."""
        audio, lo, hi = self._span(start_ms, end_ms)
        rest = audio[hi:]
        self.chunks = [rest] if len(rest) else []
        self.start_sample += hi
        return audio[lo:hi]

    def clear(self) -> None:
        self.chunks = []
        self.start_sample = self.total_samples

    def keep_last(self, ms: int) -> None:
        """Drops all but the last `ms` (the prefix padding a coming speech start may need)."""
        keep = ms * SESSION_RATE // 1000
        if self.samples > 2 * keep + SESSION_RATE:  # trim in steps, not on every append
            self.take(end_ms=(self.total_samples - keep) * 1000 // SESSION_RATE)
