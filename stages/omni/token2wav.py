"""Stage kind `token2wav`: Qwen2.5-Omni codec tokens -> 24 kHz speech, streamed in windows.

Input `codes` (tokens, streaming: the talker's codec ids as they come; a complete list on a
non-streaming edge works too). Output `audio` (streaming): float32 mono waveform chunks at
24 kHz, in order; their concatenation is the request's speech.

Each step gathers the DiT windows that are ready across requests (oldest request first, one
window per request, or up to `windows_per_request`; windows of different voices, lengths and
requests share one forward, laid end to end), solves their ODE together, then vocodes every request's
newly final mel frames and emits the audio. A request waiting for codes holds nobody up: it
simply has no ready window. See docs/omni.md ("token2wav") for the window rules.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace
from typing import Any, ClassVar

import torch

from omnistage.errors import InvalidRequestError
from omnistage.stages.base import Emission, Port, StageContext, StageEngine, StageRequest, StepRecord
from omnistage.stages.omni.token2wav_model import OdeSettings, load_token2wav
from omnistage.stages.omni.token2wav_windows import RequestNoise, Span, Token2WavRequest, WindowSettings
from omnistage.stages.params import MAX_SEED, MIN_SEED, Param, ParamSet
from omnistage.stages.registry import register_stage

MODES = ("stream", "full")
_ODE, _WINDOW = OdeSettings(), WindowSettings()
# Set under the stage's YAML params these are its defaults; a request may override each one.
_WINDOW_AND_ODE = (
    Param(
        "voice",
        "string",
        None,
        "Voice from the checkpoint's spk_dict.pt (default: Chelsie, else the first).",
        nullable=True,
    ),
    Param(
        "mode",
        "string",
        "stream",
        "stream: audio window by window as codes come; full: one decode at the end.",
        choices=MODES,
    ),
    Param("first_window_blocks", "integer", _WINDOW.first_blocks, "DiT blocks in a request's first window.", minimum=1),
    Param(
        "first_windows",
        "integer",
        _WINDOW.first_count,
        "Windows of first_window_blocks before the sizes start doubling.",
        minimum=1,
    ),
    Param(
        "window_blocks",
        "integer",
        _WINDOW.steady_blocks,
        "DiT blocks of the steady windows (after the first ones, each window doubles up to this).",
        minimum=1,
    ),
    Param("past_blocks", "integer", _WINDOW.past_blocks, "Blocks of left context a window attends to.", minimum=0),
    Param("future_blocks", "integer", _WINDOW.future_blocks, "Blocks of look-ahead a window waits for.", minimum=0),
    Param("vocoder_overlap", "integer", _WINDOW.vocoder_overlap, "Mel frames re-vocoded at a window seam.", minimum=0),
    Param(
        "num_steps",
        "integer",
        _ODE.num_steps,
        "ODE time points per window (4 DiT passes per interval): 10 is the model's; fewer are faster, approximate.",
        minimum=2,
    ),
    Param("guidance_scale", "number", _ODE.guidance_scale, "Classifier-free guidance scale.", minimum=0),
    Param("sway_coefficient", "number", _ODE.sway_coefficient, "Sway-sampling coefficient of the ODE time grid."),
)
STAGE_PARAMS = ParamSet(
    "token2wav stage",
    _WINDOW_AND_ODE
    + (
        Param("max_codes", "integer", 16384, "Most codec tokens one request may send.", minimum=1),
        Param("windows_per_request", "integer", 1, "Most windows of one request in one forward.", minimum=1),
        Param(
            "vocoder_batch_size",
            "integer",
            1,
            "Most equal-length vocoder windows in one BigVGAN forward (on CPU one at a time is fastest).",
            minimum=1,
        ),
        Param("end_codes", "integer_list", (), "Codec ids that end a request's codes (the talker's end id)."),
        Param(
            "weight_prefix", "string", None, "Weights' prefix in the checkpoint (default: the model's).", nullable=True
        ),
        Param("voices_file", "string", None, "Voices file (default: spk_dict.pt beside the weights).", nullable=True),
    ),
)
# A request's value overrides the stage's, which is therefore its default.
REQUEST_PARAMS = ParamSet(
    "token2wav request",
    tuple(replace(p, default=None, description=f"{p.description} Default: the stage's.") for p in _WINDOW_AND_ODE)
    + (
        Param("speaker", "string", None, "Another name for voice.", nullable=True),
        Param(
            "seed",
            "integer",
            None,
            "Seed of the request's ODE noise (default: random).",
            minimum=MIN_SEED,
            maximum=MAX_SEED,
            nullable=True,
        ),
    ),
)


def _codes_of(chunk: Any) -> list[int]:
    if isinstance(chunk, torch.Tensor):
        if chunk.is_floating_point():
            raise InvalidRequestError("codec tokens must be integers", param="codes")
        return [int(c) for c in chunk.reshape(-1).tolist()]
    if isinstance(chunk, int) and not isinstance(chunk, bool):
        return [chunk]
    if isinstance(chunk, (list, tuple)) and all(isinstance(c, int) and not isinstance(c, bool) for c in chunk):
        return list(chunk)
    raise InvalidRequestError(f"codec tokens must be integers, got {type(chunk).__name__}", param="codes")


@register_stage("token2wav")
class Token2WavStage(StageEngine):
    # voice (optional): the talker's voice name, sent before its first codes (the request's own voice param wins)
    inputs: ClassVar[dict[str, Port]] = {
        "codes": Port("tokens", streaming=True),
        "voice": Port("json", streaming=True, optional=True),
    }
    outputs: ClassVar[dict[str, Port]] = {"audio": Port("audio", streaming=True)}
    batching_policies = ("dynamic", "none")
    needs_model = True
    sample_rate = 24_000
    stage_params = STAGE_PARAMS
    request_params = REQUEST_PARAMS

    def __init__(self, ctx: StageContext):
        super().__init__(ctx)
        p = STAGE_PARAMS.validate(ctx.params)
        prefix = ctx.model_prefix if p["weight_prefix"] is None else p["weight_prefix"]
        self.net = load_token2wav(str(ctx.model_path), ctx.device, prefix, p["voices_file"])
        self.defaults = p
        self.default_voice = p.get("voice") or (
            "Chelsie" if "Chelsie" in self.net.voices else next(iter(self.net.voices))
        )
        if self.default_voice not in self.net.voices:
            raise ValueError(
                f"voice {self.default_voice!r} is not in the checkpoint's voices {sorted(self.net.voices)}"
            )
        self.max_codes = p["max_codes"]
        self.end_codes = set(p["end_codes"])
        self.max_windows = max(1, ctx.batching.max_batch_size)
        self.windows_per_request = p["windows_per_request"]
        self.vocoder_batch_size = p["vocoder_batch_size"]
        self.requests: dict[str, Token2WavRequest] = {}
        self._pending: list[Emission] = []
        self._vocode_rest = False  # the last step sent first audio ahead of other windows
        self.totals = {"forwards": 0, "windows": 0, "max_windows_per_forward": 0, "audio_seconds": 0.0}

    # -- requests -------------------------------------------------------------------------
    def _settings(self, params: dict[str, Any]) -> tuple[OdeSettings, WindowSettings]:
        merged = {**self.defaults, **params}
        ode = OdeSettings()
        ode = replace(ode, **{k: merged[k] for k in ("num_steps", "guidance_scale", "sway_coefficient") if k in merged})
        keys = {
            "first_window_blocks": "first_blocks",
            "first_windows": "first_count",
            "window_blocks": "steady_blocks",
            "past_blocks": "past_blocks",
            "future_blocks": "future_blocks",
            "vocoder_overlap": "vocoder_overlap",
        }
        win = WindowSettings(**{field: merged[k] for k, field in keys.items() if k in merged})
        return ode, replace(win, full=merged.get("mode", "stream") == "full")

    def _new_request(self, request: StageRequest) -> Token2WavRequest:
        # unfilled: a key the request leaves out keeps the stage's value
        params = REQUEST_PARAMS.validate(request.params, fill_defaults=False)
        named = params.get("voice") or params.get("speaker")
        voice = self._voice(named or self.default_voice)
        ode, windows = self._settings(params)
        seed = params.get("seed")
        return Token2WavRequest(
            request_id=request.request_id,
            voice=voice,
            voice_named=bool(named),
            ode=ode,
            windows=windows,
            noise=RequestNoise(random.randrange(2**63) if seed is None else seed, self.net.mel_dim),
            max_codes=self.max_codes,
            repeats=self.net.repeats,
            arrival=request.arrival,
        )

    def _voice(self, name: Any):
        if name not in self.net.voices:
            raise InvalidRequestError(
                f"unknown voice {name!r}; available: {', '.join(sorted(self.net.voices))}", param="voice"
            )
        return self.net.voices[name]

    def add(self, request: StageRequest) -> None:
        rid = request.request_id
        try:
            if rid in self.requests:
                raise ValueError(f"request {rid!r} is already in token2wav")
            state = self._new_request(request)
            if request.inputs.get("codes") is not None:
                self._take_codes(state, request.inputs["codes"], last=True)
        except InvalidRequestError as exc:
            self._pending.append(Emission(rid, finished=True, error=str(exc), error_kind="invalid_request"))
            return
        self.requests[rid] = state

    def _take_codes(self, state: Token2WavRequest, chunk: Any, last: bool) -> None:
        if state.ended:
            return
        codes = _codes_of(chunk)
        cut = next((i for i, c in enumerate(codes) if c in self.end_codes), None)
        if cut is not None:
            codes, last = codes[:cut], True
        state.add_codes(codes, self.net.num_codes)
        state.ended = last
        if state.windows.full and state.known > self.net.max_frames:
            raise InvalidRequestError(
                f"full mode decodes at most {self.net.max_frames // state.repeats} codec tokens", param="mode"
            )

    def feed(self, request_id: str, port: str, chunk: Any, last: bool) -> None:
        state = self.requests.get(request_id)
        if state is None:
            return
        try:
            if port == "voice":
                if chunk and not state.voice_named and not state.known:
                    state.voice = self._voice(chunk)
            else:
                self._take_codes(state, chunk, last)
        except InvalidRequestError as exc:
            del self.requests[request_id]
            self._pending.append(Emission(request_id, finished=True, error=str(exc), error_kind="invalid_request"))

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self._pending = [e for e in self._pending if e.request_id != request_id]

    def num_requests(self) -> int:
        return len(self.requests)

    def has_work(self) -> bool:
        block = self.net.block_frames
        return bool(self._pending) or any(s.ready(block) for s in self.requests.values())

    # -- stepping -------------------------------------------------------------------------
    def _pick_windows(self) -> list[tuple[Token2WavRequest, Span, Any]]:
        """Ready DiT windows for one forward: oldest request first, one window per request per
        round for up to `windows_per_request` rounds, all with the first pick's ODE settings, at
        most max_batch_size windows. A request without audio yet sends only its first window
        (a small forward: low first-audio latency)."""
        block = self.net.block_frames
        queue = sorted(self.requests.values(), key=lambda s: s.arrival)
        cursor = {s.request_id: s.written for s in queue}
        picked: list[tuple[Token2WavRequest, Span, Any]] = []
        ode = None
        for round_ in range(self.windows_per_request):
            before = len(picked)
            for state in queue:
                if len(picked) >= self.max_windows or (ode is not None and state.ode != ode):
                    continue
                if round_ and state.written == 0:
                    continue
                nxt = state.next_window(block, after=cursor[state.request_id])
                if nxt is not None:
                    ode = state.ode
                    picked.append((state, *nxt))
                    cursor[state.request_id] = nxt[0].end
            if len(picked) == before:
                break
        return picked

    def step(self) -> list[Emission]:
        emissions, self._pending = self._pending, []
        if self._vocode_rest:
            self._vocode_rest = False
            return emissions + self._vocode_ready()
        picked = self._pick_windows()
        if picked:
            t0 = time.perf_counter()
            try:
                mels = self.net.sample_mels([w for _, _, w in picked], picked[0][0].ode)
            except Exception as exc:  # noqa: BLE001 - the batch's requests fail, the stage lives
                return emissions + self._fail({s.request_id for s, _, _ in picked}, exc)
            for (state, span, _), mel in zip(picked, mels):
                state.take_mel(span, mel)
            self._record(picked, time.perf_counter() - t0)
        emissions += self._vocode_ready(first_audio_ahead=True)
        return emissions

    def _record(self, picked, seconds: float) -> None:
        frames = [w.noise.shape[0] for _, _, w in picked]
        self.totals["forwards"] += 1
        self.totals["windows"] += len(picked)
        self.totals["max_windows_per_forward"] = max(self.totals["max_windows_per_forward"], len(picked))
        ids = tuple(s.request_id for s, _, _ in picked)
        self.step_log.append(StepRecord(ids, len(picked), seconds, {"frames": frames}))

    def _vocode_ready(self, first_audio_ahead: bool = False) -> list[Emission]:
        """Vocode every request's ready window (up to vocoder_batch_size of equal length share a
        forward) and emit audio; finished requests leave. `first_audio_ahead`: when some
        listeners still wait for their first audio, only their windows, sent at once; the
        next step vocodes the rest before any DiT forward."""
        windows = [(state, *win) for state in self.requests.values() if (win := state.vocoder_window()) is not None]
        if first_audio_ahead:
            first = [w for w in windows if w[0].vocoded == 0]
            if first and len(first) < len(windows):
                windows, self._vocode_rest = first, True
        ready: dict[int, list[tuple[Token2WavRequest, Span, torch.Tensor]]] = {}
        for state, span, mel in windows:
            ready.setdefault(mel.shape[0], []).append((state, span, mel))
        audio: dict[str, torch.Tensor] = {}
        failed: set[str] = set()
        per = self.net.samples_per_frame
        size = self.vocoder_batch_size
        groups = [same[i : i + size] for same in ready.values() for i in range(0, len(same), size)]
        for group in groups:
            try:
                waves = self.net.vocode([mel for _, _, mel in group])
            except Exception as exc:  # noqa: BLE001
                failed |= {s.request_id for s, _, _ in group}
                error = exc
                continue
            for (state, span, _), wave in zip(group, waves):
                audio[state.request_id] = wave[
                    (span.start - span.read_start) * per : (span.end - span.read_start) * per
                ]
                state.vocoded = span.end
        out = self._fail(failed, error) if failed else []
        for rid, state in list(self.requests.items()):
            if rid in audio or state.done:
                chunk = audio.get(rid, torch.zeros(0))
                self.totals["audio_seconds"] += chunk.numel() / self.sample_rate
                out.append(Emission(rid, outputs={"audio": chunk}, finished=state.done))
                if state.done:
                    del self.requests[rid]
        return out

    def _fail(self, request_ids: set[str], exc: BaseException) -> list[Emission]:
        for rid in request_ids:
            self.requests.pop(rid, None)
        msg = f"{type(exc).__name__}: {exc}"
        return [Emission(rid, finished=True, error=msg, error_kind="internal") for rid in sorted(request_ids)]

    def stats(self) -> dict[str, float]:
        return {f"token2wav_{k}": float(v) for k, v in self.totals.items()} | {"token2wav_requests": len(self.requests)}
