"""One live `omnistage serve tiny-omni` with an API key for the realtime tests, clients for
it (the official `openai` package and plain `websockets`), the speech clip, and the engine
figures from /metrics that show what the stages still hold."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile
import websockets
from prometheus_client.parser import text_string_to_metric_families

from omnistage.bench.realtime import preemptive_outcomes as bench_preemptive_outcomes
from omnistage.tests.api.conftest import live_server

KEY = "sk-realtime-test"
SESSIONS_PER_KEY = 4
SPEECH = Path(__file__).resolve().parents[1] / "fixtures" / "speech.wav"
RATE = 24_000


@pytest.fixture(scope="package")
def rt_server(tmp_path_factory):
    env = {"OMNISTAGE_REALTIME_SESSIONS_PER_KEY": str(SESSIONS_PER_KEY)}
    with live_server(tmp_path_factory, ["tiny-omni", "--api-key", KEY], env=env, timeout=600) as server:
        yield server


def ws_url(server, **query: str) -> str:
    params = "&".join(f"{k}={v}" for k, v in {"model": "tiny-omni", **query}.items())
    return f"ws://127.0.0.1:{server.port}/v1/realtime?{params}"


def connect(server, headers: dict[str, str] | None = None, **kw):
    """A plain websockets connection with the key as a header (unless headers say otherwise)."""
    headers = {"Authorization": f"Bearer {KEY}"} if headers is None else headers
    return websockets.connect(ws_url(server), additional_headers=headers, max_size=None, **kw)


def speech(name: str = SPEECH.name) -> np.ndarray:
    """A speech clip of tests/fixtures as pcm16 at 24 kHz (speech.wav has pauses inside it,
    speech-phrase.wav none)."""
    samples, rate = soundfile.read(SPEECH.with_name(name), dtype="int16")
    assert rate == RATE and samples.ndim == 1
    return samples


def pcm16_b64(samples: np.ndarray) -> str:
    return base64.b64encode(np.asarray(samples, dtype="<i2").tobytes()).decode()


def packets(samples: np.ndarray, ms: int = 20) -> list[str]:
    step = RATE * ms // 1000
    return [pcm16_b64(samples[i : i + step]) for i in range(0, len(samples), step)]


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(RATE * seconds), dtype=np.int16)


async def send(ws, kind: str, **fields) -> None:
    await ws.send(json.dumps({"type": kind, **fields}))


async def recv(ws, timeout: float = 120) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def until(ws, kind: str, seen: list | None = None, timeout: float = 180) -> dict:
    """Events up to the first of type `kind` (returned); the others go to `seen`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        event = await recv(ws, max(0.1, deadline - loop.time()))
        if event["type"] == kind:
            return event
        if seen is not None:
            seen.append(event)


def engine_figures(url: str) -> dict[str, dict[str, float]]:
    """stage -> {running, kv_blocks_free, kv_blocks_total, inflight} for tiny-omni, from /metrics."""
    out: dict[str, dict[str, float]] = {}
    body = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.labels.get("pipeline") != "tiny-omni" or "stage" not in s.labels:
                continue
            if s.name.startswith("omnistage_engine_"):
                key = s.name[len("omnistage_engine_") :]
            elif s.name == "omnistage_stage_inflight_requests":
                key = "inflight"
            else:
                continue
            stage = out.setdefault(s.labels["stage"], {})
            stage[key] = stage.get(key, 0.0) + s.value
    return out


def idle(figures: dict[str, dict[str, float]]) -> bool:
    return all(
        f.get("running", 0) == 0 and f.get("inflight", 0) == 0 and f.get("kv_blocks_free") == f.get("kv_blocks_total")
        for f in figures.values()
    )


def request_outcomes(url: str) -> dict[str, float]:
    """tiny-omni's pipeline requests by outcome (ok, cancelled, error, ...), from /metrics."""
    body = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name == "omnistage_pipeline_requests_total" and s.labels.get("pipeline") == "tiny-omni":
                out[s.labels["outcome"]] = s.value
    return out


def preemptive_outcomes(url: str) -> dict[str, float]:
    """Preemptive realtime responses by outcome (used, discarded), from /metrics."""
    return bench_preemptive_outcomes(url, KEY)
