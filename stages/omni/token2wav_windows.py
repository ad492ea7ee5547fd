"""Per-request state of the token2wav stage: codes so far, the request's noise, and which
block-aligned DiT windows and overlapped vocoder windows are ready.

Frames are mel frames (`repeats` per codec token, `block` per DiT block). A DiT window writes
output frames [start, end) and reads [start - past blocks, end + future blocks), clipped to
the sequence; its start is always block-aligned, so the DiT's block mask partitions it as it
partitions the whole sequence. A window waits until its future context has arrived, except
at the end of the stream. The vocoder turns final mel frames into audio once `overlap` more
frames exist on the right (all remaining frames at the end), reading `overlap` frames on
either side.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnistage.errors import InvalidRequestError
from omnistage.stages.omni.token2wav_model import DitWindow, OdeSettings, Voice


@dataclass(frozen=True)
class WindowSettings:
    """Window sizes in DiT blocks (mel frames for the vocoder overlap)."""

    first_blocks: int = 2
    first_count: int = 1  # windows of first_blocks before the sizes start doubling
    steady_blocks: int = 8
    past_blocks: int = 2
    future_blocks: int = 1
    vocoder_overlap: int = 24
    full: bool = False  # one exact decode of the whole sequence once the codes end


@dataclass(frozen=True)
class Span:
    """Output frames [start, end) of a window and the frames [read_start, read_end) it reads."""

    start: int
    end: int
    read_start: int
    read_end: int


def plan_dit_window(done: int, known: int, ended: bool, block: int, w: WindowSettings) -> Span | None:
    """The next DiT window after `done` output frames, given `known` frames of codes so far,
    or None while it still waits for codes (or when everything is written)."""
    if done >= known:
        return None
    if w.full:
        return Span(0, known, 0, known) if ended else None
    end = done + window_blocks_after(done // block, w) * block
    read_end = end + w.future_blocks * block
    if known < read_end and not ended:
        return None
    return Span(done, min(end, known), max(0, done - w.past_blocks * block), min(read_end, known))


def window_blocks_after(done_blocks: int, w: WindowSettings) -> int:
    """Blocks of the window that starts after `done_blocks`: `first_count` windows of the
    first size, then each window twice the one before until the steady size. The first audio
    waits only for a short window, the ones right after it still come soon (the listener has
    little audio buffered), and the rest are long: a window's past and future context is
    computed again for every window, so long windows cost less per second of speech."""
    size, at, windows = w.first_blocks, 0, 0
    while at < done_blocks:
        at += size
        windows += 1
        if windows >= w.first_count:
            size = min(2 * size, w.steady_blocks)
    return size


def plan_vocoder_window(vocoded: int, final: int, all_final: bool, overlap: int) -> Span | None:
    """The next vocoder window after `vocoded` frames when `final` mel frames are known."""
    end = final if all_final else final - overlap
    if end <= vocoded:
        return None
    return Span(vocoded, end, max(0, vocoded - overlap), min(final, end + overlap))


class RequestNoise:
    """The ODE's initial noise of one request: one stream of normal draws from the request's
    seeded generator, as if drawn at once as randn([frames, mel_dim]) for its whole length.

    Rows are drawn as the codes grow. Torch's CPU normal sampler fills whole 16-value groups
    from consecutive uniforms, so successive draws whose sizes are multiples of 16 (a mel row
    has 80 values) continue one draw exactly; `tests/omni/test_token2wav_windows.py` checks it."""

    def __init__(self, seed: int, mel_dim: int, chunk_rows: int = 240):
        self.generator = torch.Generator("cpu").manual_seed(seed)
        self.mel_dim = mel_dim
        self.chunk_rows = chunk_rows
        self.rows = torch.empty(0, mel_dim)

    def slice(self, start: int, end: int) -> torch.Tensor:
        if end > self.rows.shape[0]:
            need = max(end - self.rows.shape[0], self.chunk_rows)
            more = torch.randn([need, self.mel_dim], generator=self.generator)
            self.rows = torch.cat([self.rows, more])
        return self.rows[start:end]


@dataclass
class Token2WavRequest:
    """What the stage keeps for one request between steps."""

    request_id: str
    voice: Voice
    ode: OdeSettings
    windows: WindowSettings
    noise: RequestNoise
    max_codes: int
    repeats: int
    arrival: float
    voice_named: bool = False  # the request's params named the voice (a `voice` input then does not change it)
    codes: list[int] = field(default_factory=list)
    ended: bool = False
    written: int = 0  # mel frames the DiT has finished
    vocoded: int = 0  # mel frames turned into audio
    mel: list[torch.Tensor] = field(default_factory=list)  # finished mel pieces, in order

    @property
    def known(self) -> int:
        return len(self.codes) * self.repeats

    def add_codes(self, codes: list[int], num_embeds: int) -> None:
        bad = [c for c in codes if not 0 <= c < num_embeds]
        if bad:
            raise InvalidRequestError(f"codec ids must be in [0, {num_embeds}), got {bad[:5]}", param="codes")
        if len(self.codes) + len(codes) > self.max_codes:
            raise InvalidRequestError(f"more than max_codes={self.max_codes} codec tokens", param="codes")
        self.codes.extend(codes)

    def next_window(self, block: int, after: int | None = None) -> tuple[Span, DitWindow] | None:
        """The next ready DiT window after `after` output frames (default: those written)."""
        done = self.written if after is None else after
        span = plan_dit_window(done, self.known, self.ended, block, self.windows)
        if span is None:
            return None
        r = self.repeats
        codes = torch.tensor(self.codes[span.read_start // r : span.read_end // r], dtype=torch.long)
        return span, DitWindow(codes, self.noise.slice(span.read_start, span.read_end), self.voice)

    def ready(self, block: int) -> bool:
        """True when a step would do something for this request (a DiT or vocoder window, or
        its end); plans only, builds nothing."""
        if self.done or plan_dit_window(self.written, self.known, self.ended, block, self.windows) is not None:
            return True
        all_final = self.ended and self.written >= self.known
        return plan_vocoder_window(self.vocoded, self.written, all_final, self.windows.vocoder_overlap) is not None

    def take_mel(self, span: Span, mel: torch.Tensor) -> None:
        self.mel.append(mel[span.start - span.read_start : span.end - span.read_start])
        self.written = span.end

    def vocoder_window(self) -> tuple[Span, torch.Tensor] | None:
        all_final = self.ended and self.written >= self.known
        span = plan_vocoder_window(self.vocoded, self.written, all_final, self.windows.vocoder_overlap)
        if span is None:
            return None
        if len(self.mel) > 1:
            self.mel = [torch.cat(self.mel)]
        return span, self.mel[0][span.read_start : span.read_end]

    @property
    def done(self) -> bool:
        return self.ended and self.vocoded >= self.known
