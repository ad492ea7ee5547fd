"""`omnistage bench realtime [--sessions 1,4,16] [--json FILE] [--quick]`: voice sessions on
the tiny omni pipeline over WS /v1/realtime, as a user hears them.

Each simulated client streams a microphone in real time (20 ms pcm16 packets at 24 kHz:
silence, then the speech clip tests/fixtures/speech-phrase.wav, then silence again) with server VAD
on, and plays every answer through a simulated player (playback starts with the first audio
delta and runs in real time). Per session: `--turns` spoken turns; in the last one the user
talks again as soon as the answer starts (barge-in). Per N sessions (all at once), over
`--repeat` runs (median, min, max of each figure):
- v2v_ms_p50 / p99: end of the user's speech (the packet holding the clip's last loud sample
  sent; the clip's 0.28 s of trailing silence does not count as speech) to the answer's first
  audio delta; it includes the VAD's `silence_duration_ms` (`--silence-ms`, 200 here).
- underrun_ms_total: over all sessions, the time the player had nothing to play between an
  answer's first audio delta and its last (a gap in the audio the user hears).
- bargein_ms_p99: start of the interrupting speech (the packet holding its onset sent) to
  the last audio delta of the interrupted answer (0 when none came after); bargein_done_ms_p99
  to its response.done (status cancelled); bargein_count: answers still streaming when
  interrupted (a short answer may already be complete).
- cached_token_share: cached / input tokens of turns after the first (the session's prefix
  cache under its salt).
- preemptive_used / preemptive_discarded: responses the server started at a pause in the
  speech (serving/realtime/early.py) that the turn then used, or that it aborted because the
  user went on (work spent for nothing), from the server's /metrics.
- answers (with audio), answers_without_audio (status and codec tokens of each; the random
  tiny talker can end at its first step), interruptions_not_spoken (a barge-in turn whose
  answer had no audio: the user had nothing to talk over, so nothing more is awaited).
A session that gets no event for `--event-timeout` seconds fails the run with its last events.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

RATE = 24_000
PACKET_MS = 20
PACKET = RATE * PACKET_MS // 1000
CLIP = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "speech-phrase.wav"  # one phrase, no pause
FIGURES = ("underrun_ms_total", "v2v_ms_p50", "v2v_ms_p99", "bargein_ms_p99", "bargein_done_ms_p99")


@dataclass(frozen=True)
class Plan:
    sessions: tuple[int, ...]
    turns: int
    max_output_tokens: int
    repeat: int
    silence_ms: int
    api_key: str | None = None
    event_timeout_s: float = 600.0

    @classmethod
    def make(cls, args: argparse.Namespace) -> Plan:
        sessions = tuple(int(s) for s in args.sessions.split(",")) if args.sessions else None
        quick = args.quick
        return cls(
            sessions or ((1, 2) if quick else (1, 4, 16)),
            args.turns or (2 if quick else 3),
            6 if quick else 24,  # max_output_tokens
            args.repeat or (1 if quick else 3),
            args.silence_ms,
            args.api_key,
            args.event_timeout,
        )


@dataclass
class SessionLog:
    v2v_ms: list[float] = field(default_factory=list)
    underrun_ms: float = 0.0
    bargein_ms: list[float] = field(default_factory=list)
    bargein_done_ms: list[float] = field(default_factory=list)
    cached: int = 0
    later_input: int = 0
    audio_bytes: int = 0
    silent: list[str] = field(default_factory=list)  # each response that ended without audio: status, codec tokens
    interruptions_not_spoken: int = 0  # barge-in turns whose answer had no audio to talk over
    errors: list[str] = field(default_factory=list)
    recent: deque = field(default_factory=lambda: deque(maxlen=60))  # the last events, for a stall's report


def _summary(e: dict[str, Any]) -> str:
    """An event in a few words: its type, the response it belongs to, a response's status."""
    response = e.get("response") or {}
    rid = e.get("response_id") or response.get("id") or ""
    status = response.get("status") if e["type"] == "response.done" else None
    return " ".join(str(x) for x in (e["type"], rid[-8:], status) if x)


def _clip() -> tuple[np.ndarray, int, int]:
    """The speech clip, and the indices of its first and last loud samples (onset, end)."""
    import soundfile

    samples, rate = soundfile.read(CLIP, dtype="int16")
    assert rate == RATE, f"{CLIP} must be {RATE} Hz"
    loud = np.nonzero(np.abs(samples) > 0.05 * np.abs(samples).max())[0]
    return samples, int(loud[0]), int(loud[-1])


class Microphone:
    """Sends a 20 ms packet every 20 ms: queued speech, else silence. Notes when the packets
    holding a clip's onset and its speech's end were sent; `sent` is set once the whole clip
    has left."""

    def __init__(self, ws):
        self.ws, self.queue, self.sent = ws, [], asyncio.Event()
        self.onset_at = self.end_at = 0.0

    def say(self, samples: np.ndarray, onset: int, end: int) -> None:
        packets = [samples[i : i + PACKET] for i in range(0, len(samples), PACKET)]
        marks = [(i == onset // PACKET, i == end // PACKET, i == len(packets) - 1) for i in range(len(packets))]
        self.queue = [(p, *m) for p, m in zip(packets, marks)]
        self.sent.clear()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        t0, n = loop.time(), 0
        silent = np.zeros(PACKET, dtype=np.int16)
        while True:
            packet, onset, end, last = self.queue.pop(0) if self.queue else (silent, False, False, False)
            audio = base64.b64encode(np.asarray(packet, dtype="<i2").tobytes()).decode()
            await self.ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
            now = loop.time()
            if onset:
                self.onset_at = now
            if end:
                self.end_at = now
            if last:
                self.sent.set()
            n += 1
            await asyncio.sleep(max(0.0, t0 + n * PACKET_MS / 1000 - loop.time()))


class Player:
    """Real-time playback from the first delta; counts the time it ran dry before the last one."""

    def __init__(self) -> None:
        self.cursor: float | None = None
        self.underrun = 0.0

    def push(self, now: float, nbytes: int) -> None:
        if self.cursor is None:
            self.cursor = now
        elif now > self.cursor:
            self.underrun += now - self.cursor
            self.cursor = now
        self.cursor += nbytes / 2 / RATE

    def ends_at(self) -> float:
        return self.cursor or 0.0


async def _answer(ws, mic: Microphone, log: SessionLog, turn: int, interrupt: tuple | None, timeout_s: float) -> bool:
    """Reads events up to this turn's response.done; returns whether the answer had audio
    (with `interrupt`: whether the user talked over it)."""
    loop = asyncio.get_running_loop()
    player, rid, first, last_delta = Player(), None, None, None
    log.recent.append(f"(turn {turn}: reading its answer)")
    while True:
        try:
            e = json.loads(await asyncio.wait_for(ws.recv(), timeout_s))
        except TimeoutError:
            waiting = f"response.done of {rid}" if rid else "a response.created"
            raise RuntimeError(
                f"turn {turn}: no event for {timeout_s:g} s while waiting for {waiting}; "
                f"the last events: {list(log.recent)}"
            ) from None
        kind = e["type"]
        if kind != "response.output_audio.delta":
            log.recent.append(_summary(e))
        if kind == "error":
            log.errors.append(e["error"]["message"])
        elif kind == "response.created" and rid is None:
            rid = e["response"]["id"]
        elif kind == "response.output_audio.delta" and e["response_id"] == rid:
            now, n = loop.time(), len(base64.b64decode(e["delta"]))
            log.audio_bytes += n
            if first is None:
                first = now
                log.v2v_ms.append((now - mic.end_at) * 1000)
                if interrupt is not None:
                    mic.say(*interrupt)
            last_delta = now
            player.push(now, n)
        elif kind == "response.done" and e["response"]["id"] == rid:
            usage = e["response"]["usage"] or {}
            if first is None:
                codec = (usage.get("output_token_details") or {}).get("audio_tokens")
                log.silent.append(f"{e['response']['status']}, {codec} codec tokens")
            log.underrun_ms += player.underrun * 1000
            if turn > 0:
                log.cached += usage.get("input_token_details", {}).get("cached_tokens", 0)
                log.later_input += usage.get("input_tokens", 0)
            if interrupt is not None and e["response"]["status"] == "cancelled":
                log.bargein_ms.append(max(0.0, (last_delta or 0) - mic.onset_at) * 1000)
                log.bargein_done_ms.append((loop.time() - mic.onset_at) * 1000)
            await asyncio.sleep(max(0.0, player.ends_at() - loop.time()))  # the user listens to the end
            return first is not None


async def _session(url: str, plan: Plan, index: int, log: SessionLog) -> None:
    import websockets

    clip = _clip()
    headers = {"Authorization": f"Bearer {plan.api_key}"} if plan.api_key else None
    # no keepalive pings: a loaded server may lag behind the microphone for seconds
    async with websockets.connect(url, max_size=None, ping_interval=None, additional_headers=headers) as ws:
        json.loads(await ws.recv())
        vad = {"type": "server_vad", "silence_duration_ms": plan.silence_ms}
        session = {
            "max_output_tokens": plan.max_output_tokens,
            "seed": index,
            "audio": {"input": {"turn_detection": vad}},
        }
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        mic = Microphone(ws)
        mic_task = asyncio.create_task(mic.run())
        try:
            await asyncio.sleep(0.05 * index)  # sessions do not all start speaking on the same packet
            for turn in range(plan.turns):
                mic.onset_at = 0.0
                mic.say(*clip)
                await mic.sent.wait()
                barge = clip if turn == plan.turns - 1 else None
                spoke = await _answer(ws, mic, log, turn, barge, plan.event_timeout_s)
                if barge is not None and spoke:
                    await _answer(ws, mic, log, turn + 1, None, plan.event_timeout_s)  # what the interruption asked
                elif barge is not None:
                    # an answer without audio (the random talker can end at its first step)
                    # gives the user nothing to talk over: no interruption, no answer to wait for
                    log.interruptions_not_spoken += 1
        finally:
            mic_task.cancel()


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def preemptive_outcomes(http_url: str, api_key: str | None = None) -> dict[str, float]:
    """A server's preemptive realtime responses so far, by outcome (used, discarded), from its /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = httpx.get(http_url + "/metrics", headers=headers, timeout=30).text
    out = {"used": 0.0, "discarded": 0.0}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name == "omnistage_realtime_preemptive_responses_total":
                out[s.labels["outcome"]] = s.value
    return out


async def _level(url: str, plan: Plan, n: int) -> dict[str, Any]:
    logs = [SessionLog() for _ in range(n)]
    start = time.perf_counter()
    http_url = url.replace("ws", "http", 1)
    before = await asyncio.to_thread(preemptive_outcomes, http_url, plan.api_key)
    await asyncio.gather(*(_session(f"{url}/v1/realtime?model=tiny-omni", plan, i, logs[i]) for i in range(n)))
    after = await asyncio.to_thread(preemptive_outcomes, http_url, plan.api_key)
    v2v = [v for g in logs for v in g.v2v_ms]
    later = sum(g.later_input for g in logs)
    return {
        "underrun_ms_total": sum(g.underrun_ms for g in logs),
        "v2v_ms_p50": _pct(v2v, 0.5),
        "v2v_ms_p99": _pct(v2v, 0.99),
        "bargein_ms_p99": _pct([b for g in logs for b in g.bargein_ms], 0.99),
        "bargein_done_ms_p99": _pct([b for g in logs for b in g.bargein_done_ms], 0.99),
        "bargein_count": sum(len(g.bargein_ms) for g in logs),
        "cached_token_share": sum(g.cached for g in logs) / later if later else 0.0,
        "answers": len(v2v),
        "answers_without_audio": sorted(s for g in logs for s in g.silent),
        "interruptions_not_spoken": sum(g.interruptions_not_spoken for g in logs),
        "preemptive_used": int(after["used"] - before["used"]),
        "preemptive_discarded": int(after["discarded"] - before["discarded"]),
        "audio_s_received": sum(g.audio_bytes for g in logs) / 2 / RATE,
        "errors": [e for g in logs for e in g.errors],
        "wall_s": time.perf_counter() - start,
    }


def _summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median run's figures, with each figure's min and max over the runs."""
    out: dict[str, Any] = dict(runs[len(runs) // 2])
    for key in (*FIGURES, "cached_token_share"):
        values = [r[key] for r in runs]
        out[key] = statistics.median(values)
        out[f"{key}_range"] = [min(values), max(values)]
    out["runs"] = runs
    return out


def run_bench(url: str, plan: Plan, progress: bool) -> dict[str, Any]:
    shown = {k: v for k, v in plan.__dict__.items() if k != "api_key"}
    result: dict[str, Any] = {"bench": "realtime", "plan": shown | {"sessions": list(plan.sessions)}}
    for n in plan.sessions:
        runs = []
        for r in range(plan.repeat):
            runs.append(asyncio.run(_level(url, plan, n)))
            if progress:
                fig = runs[-1]
                print(
                    f"[bench realtime] {n} sessions run {r + 1}: v2v p50 {fig['v2v_ms_p50']:.0f} ms, "
                    f"underrun {fig['underrun_ms_total']:.0f} ms, barge-in p99 {fig['bargein_ms_p99']:.0f} ms",
                    file=sys.stderr,
                )
        result[f"sessions_{n}"] = _summarise(runs)
    clean = [n for n in plan.sessions if result[f"sessions_{n}"]["underrun_ms_total"] == 0]
    result["sessions_without_underrun"] = max(clean) if clean else 0
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="omnistage bench realtime", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sessions", help="comma-separated session counts (default 1,4,16; --quick 1,2)")
    ap.add_argument("--turns", type=int, help="spoken turns per session, the last one interrupted (default 3)")
    ap.add_argument("--repeat", type=int, help="runs per session count (default 3; --quick 1)")
    ap.add_argument("--silence-ms", type=int, default=200, help="server VAD silence_duration_ms")
    ap.add_argument("--url", help="an omnistage server already serving tiny-omni (default: start one)")
    ap.add_argument("--api-key", help="the server's API key (with --url)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 and 2 sessions, 2 turns, short answers")
    ap.add_argument(
        "--event-timeout", type=float, default=600.0, help="seconds a session waits for its next event before failing"
    )
    ap.add_argument("--json", dest="json_path", help="write the results to this file")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    plan = Plan.make(args)
    if args.url:
        from omnistage.bench.api import _wait_ready

        _wait_ready(args.url.rstrip("/"), _Running(), timeout=600)
        result = run_bench(args.url.rstrip("/").replace("http", "ws", 1), plan, not args.no_progress)
    else:
        result = _with_server(plan, not args.no_progress)
    result["command"] = "omnistage bench realtime " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items()}, indent=2, default=str))
    return 0


class _Running:
    """A server this run did not start: never seen to exit."""

    returncode = None

    def poll(self):
        return None


def _with_server(plan: Plan, progress: bool) -> dict[str, Any]:
    from omnistage.bench.api import _free_port, _wait_ready

    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        proc = _serve(port, Path(tmp))
        try:
            _wait_ready(f"http://127.0.0.1:{port}", proc, timeout=600)
            return run_bench(f"ws://127.0.0.1:{port}", plan, progress)
        finally:
            proc.terminate()
            proc.wait(60)


def _serve(port: int, log_dir: Path):
    import os
    import subprocess

    env = {**os.environ, "PYTHONSAFEPATH": "1", "OMNISTAGE_JOBS_DIR": str(log_dir / "jobs")}
    omnistage = Path(sys.executable).parent / "omnistage"
    log = open(log_dir / "server.log", "wb")
    cmd = [str(omnistage), "serve", "tiny-omni", "--port", str(port), "--log-level", "warning"]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


if __name__ == "__main__":
    sys.exit(main())
