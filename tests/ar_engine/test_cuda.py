"""The AR engine on a CUDA device gives the CPU engine's greedy tokens, with the torch path
and with the compiled Triton kernels, run eagerly or with decode replayed from CUDA graphs. Runs only where torch sees a CUDA device.

The suite sets TRITON_INTERPRET=1 before anything imports triton (tests/conftest.py), which
would run the kernels in the interpreter; the CUDA engine therefore runs in a child process
without it, so the kernels are compiled as in production.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from omnistage.stages.ar import EngineConfig, LLMEngine, SamplingParams

from .conftest import VOCAB, assert_pool_full, hf_greedy, run_to_completion

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NEW = 16

CHILD = """
import json, sys
from omnistage.stages.ar import EngineConfig, LLMEngine
from omnistage.tests.ar_engine.test_cuda import greedy_in_two_waves
path, prompts = sys.argv[1], json.loads(sys.argv[2])
engine = LLMEngine(EngineConfig(model_path=path, device="cuda", num_kv_blocks=64, block_size=8))
out = greedy_in_two_waves(engine, prompts)
out["uses_triton"] = engine.uses_triton
out["graph_replays"] = engine.stats()["decode_graph_replays"]
print("RESULT " + json.dumps(out))
"""


def greedy_in_two_waves(engine: LLMEngine, prompts: list[list[int]]) -> dict:
    """All prompts but the last as one batch, then the last (which shares a prefix with the one
    before it: a prefix-cache hit): tokens and their logprobs, as plain lists."""
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    res = {}
    for wave in (range(len(prompts) - 1), [len(prompts) - 1]):
        for i in wave:
            engine.add_request(f"r{i}", prompts[i], sp)
        res.update(run_to_completion(engine))
    assert_pool_full(engine)
    runs = [res[(f"r{i}", 0)] for i in range(len(prompts))]
    return {
        "tokens": [r["tokens"] for r in runs],
        "logprobs": [[lp[t] for lp, t in zip(r["logprobs"], r["tokens"])] for r in runs],
        "cached": engine.stats()["prefix_cache_hit_tokens"],
    }


def _prompts() -> tuple[list[list[int]], int]:
    """Prompts of different lengths (a batch of decodes, chunked prefill); the last two share a
    24-token prefix (3 full blocks)."""
    rng = random.Random(21)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 17, 40, 63)]
    prefix = [rng.randrange(VOCAB) for _ in range(24)]
    prompts += [prefix + [rng.randrange(VOCAB) for _ in range(9)], prefix + [rng.randrange(VOCAB) for _ in range(4)]]
    return prompts, 24


def _cuda_engine(path: str, prompts, triton: bool, graphs: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMNISTAGE_TRITON="1" if triton else "0", PYTHONSAFEPATH="1")
    env.update(OMNISTAGE_CUDA_GRAPHS="1" if graphs else "0")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, path, json.dumps(prompts)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


@pytest.mark.parametrize(
    "triton,graphs", [(False, False), (True, False), (True, True)], ids=["torch", "triton", "triton-graphs"]
)
def test_cuda_engine_tokens_equal_the_cpu_engine(qwen2_gqa_tied, triton, graphs):
    path, hf_model = qwen2_gqa_tied
    prompts, shared = _prompts()
    cpu = greedy_in_two_waves(LLMEngine(EngineConfig(model_path=path, num_kv_blocks=64, block_size=8)), prompts)
    assert cpu["tokens"][0] == hf_greedy(hf_model, prompts[0], NEW)[0]  # the CPU side is itself right
    assert cpu["cached"] == shared

    cuda = _cuda_engine(path, prompts, triton, graphs)
    assert cuda["uses_triton"] is triton
    assert (cuda["graph_replays"] > 0) is graphs  # decode steps replayed from CUDA graphs
    assert cuda["tokens"] == cpu["tokens"]
    assert cuda["cached"] == shared  # the shared prefix was reused on the GPU too
    for i, (got, ref) in enumerate(zip(cuda["logprobs"], cpu["logprobs"])):
        # float32 on both devices; kernels sum in another order: agreement to ~1e-5 expected
        assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-3, i
