"""Decode steps replayed from graphs (stages/ar/decode_graphs.py), with the Triton kernels run
by the interpreter. On CPU a "graph" re-runs the captured step on its static buffers under a
watch that refuses host syncs, so these tests check what a CUDA capture depends on: the
static-buffer inputs (padding rows, block tables wider than any sequence's, lengths copied in
on the device, decode_embeds rows, M-RoPE positions) and a step body that never reads a
device value on the host. tests/ar_engine/test_cuda.py runs the real capture where a GPU is."""

from __future__ import annotations

import random

import pytest
import torch

from omnistage.stages.ar import EngineConfig, LLMEngine, SamplingParams, decode_graphs
from omnistage.stages.ar.decode_graphs import GraphKey

from ..ar_engine.conftest import hf_greedy, omni_talker, run_to_completion  # noqa: F401 (fixture)
from ..ar_engine.test_talker import NEW as TALKER_NEW
from ..ar_engine.test_talker import _reference as talker_reference
from .test_engine_triton import VOCAB
from .test_engine_triton import _checkpoint as triton_checkpoint


@pytest.fixture(scope="module")
def qwen2_gqa(tmp_path_factory):
    """8 query heads over 2 KV heads (test_engine_triton's checkpoint)."""
    return triton_checkpoint(tmp_path_factory, "qwen2")


@pytest.fixture
def graphs_on(monkeypatch):
    monkeypatch.setenv("OMNISTAGE_TRITON", "1")
    monkeypatch.setenv("OMNISTAGE_CUDA_GRAPHS", "1")


def test_graph_replays_match_transformers(qwen2_gqa, graphs_on):
    """Five sequences (padded to 8), then fewer as they finish (4, 2, 1): every decode-only
    step replays a graph, and the tokens are transformers' greedy ones."""
    path, hf = qwen2_gqa
    rng = random.Random(5)
    lengths, new = (1, 15, 16, 17, 33), (3, 4, 6, 9, 12)  # at and across the 16-token block boundary
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]
    engine = LLMEngine(EngineConfig(model_path=path, max_num_batched_tokens=128, max_num_seqs=8, block_size=16))
    assert engine.graphs is not None and engine.graphs.sizes == [1, 2, 4, 8]
    for i, (p, n) in enumerate(zip(prompts, new)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0))
    res = run_to_completion(engine)
    for i, (p, n) in enumerate(zip(prompts, new)):
        tokens, lps = hf_greedy(hf, p, n)
        got = res[(f"r{i}", 0)]
        assert got["tokens"] == tokens, f"prompt {i}"
        assert [lp[t] for lp, t in zip(got["logprobs"], tokens)] == pytest.approx(lps, abs=1e-4)
    stats = engine.stats()
    # one prefill step, then 11 decode-only steps, all replayed: 5 sequences -> the graph of
    # 8, 4 -> 4, 3 -> 4, 2 -> 2, 1 -> 1
    assert stats["steps"] == 12 and stats["decode_graph_replays"] == 11
    assert set(engine.graphs._graphs) == {GraphKey(b, 1, False) for b in (8, 4, 2, 1)}
    graph = engine.graphs._graphs[GraphKey(1, 1, False)]
    with torch.inference_mode():  # as in engine.step()
        assert graph.replay()[0] is graph.replay()[0]  # outputs alias across replays, as on CUDA
    assert engine.num_free_blocks == engine.num_total_blocks


def test_eager_fallbacks_and_captured_hidden_states(qwen2_gqa, graphs_on, monkeypatch):
    """More decoding sequences than the largest graph run eagerly; hidden states captured for a
    downstream stage come out of the graph as they come out of the eager engine."""
    path, _ = qwen2_gqa
    rng = random.Random(9)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 20, 7)]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    def run(graphs: str) -> tuple[dict, dict, LLMEngine]:
        monkeypatch.setenv("OMNISTAGE_CUDA_GRAPHS", graphs)
        engine = LLMEngine(
            EngineConfig(model_path=path, max_num_seqs=4, cuda_graph_max_batch=2, hidden_state_layers=(1, -1))
        )
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, sp)
        out: dict = {}
        hidden: dict = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
                for layer, rows in (o.hidden_states or {}).items():
                    hidden.setdefault((o.request_id, layer), []).append(rows)
        return out, {k: torch.cat(v) for k, v in hidden.items()}, engine

    eager_tokens, eager_hidden, eager = run("0")
    tokens, hidden, engine = run("1")
    assert eager.graphs is None and engine.graphs.sizes == [1, 2]
    assert tokens == eager_tokens
    assert hidden.keys() == eager_hidden.keys()
    for k in hidden:
        torch.testing.assert_close(hidden[k], eager_hidden[k], atol=1e-5, rtol=1e-5)
    # three sequences decode together (too many for the graphs) until max_tokens ends them together
    assert engine.stats()["decode_graph_replays"] == 0

    engine.add_request("solo", prompts[0], sp)
    run_to_completion(engine)
    assert engine.stats()["decode_graph_replays"] == 4
    # what a CUDA engine does at start: every size, split-K 1, with and without extra rows
    engine.graphs.capture_all(with_extra=True)
    assert set(engine.graphs._graphs) == {GraphKey(b, 1, e) for b in (1, 2) for e in (False, True)}


def test_talker_decode_embeds_and_mrope_through_graphs(omni_talker, graphs_on):  # noqa: F811
    """The talker adds a decode_embeds row to each fed-back token and rotates by 3-D positions:
    both reach the graph's static buffers (transformers' talker as the judge)."""
    path, talker = omni_talker
    g = torch.Generator().manual_seed(3)
    cases = []
    for T, K in [(9, 2), (14, 8)]:
        prompt = torch.randn(T, 48, generator=g)
        pos = torch.arange(T).unsqueeze(0).repeat(3, 1)
        pos[1, 2:6] += torch.tensor([0, 1, 0, 1])
        pos[2, 2:6] += torch.tensor([0, 0, 1, 1])
        pos[:, 6:] -= 2
        reply = torch.randn(K, 48, generator=g)
        cases.append((prompt, pos, reply, *talker_reference(talker, prompt, pos, reply)))
    engine = LLMEngine(EngineConfig(model_path=path, weight_prefix="talker."))
    for i, (prompt, pos, reply, _, _) in enumerate(cases):
        sp = SamplingParams(temperature=0, max_tokens=TALKER_NEW, ignore_eos=True, logprobs=0)
        engine.add_request(f"t{i}", None, sp, inputs_embeds=prompt, position_ids=pos, decode_embeds=reply)
    res = run_to_completion(engine)
    for i, (_, _, _, tokens, lps) in enumerate(cases):
        got = res[(f"t{i}", 0)]
        assert got["tokens"] == tokens
        assert [lp[t] for lp, t in zip(got["logprobs"], tokens)] == pytest.approx(lps, abs=1e-4)
    assert engine.stats()["decode_graph_replays"] == TALKER_NEW - 1
    assert set(engine.graphs._graphs) == {GraphKey(2, 1, True)}


def test_a_host_sync_in_the_step_is_refused():
    """The watch the CPU stand-in runs under catches what a capture would fail on or freeze:
    the rotary table sized from positions.max() (what the graphs avoid by passing a bound), a
    tensor built from host data."""
    from omnistage.stages.ar.model import RotaryEmbedding

    rotary = RotaryEmbedding(16, 1e4, None)
    positions = torch.arange(7)
    with decode_graphs._HostSyncWatch():
        rotary(positions, torch.float32, max_position=64)
        with pytest.raises(RuntimeError, match="_local_scalar_dense"):
            rotary(positions, torch.float32)
        with pytest.raises(RuntimeError, match="lift_fresh"):
            torch.tensor([1, 2, 3])  # host data copied in: frozen into a graph


def test_selection(monkeypatch):
    cuda, cpu = torch.device("cuda:0"), torch.device("cpu")
    monkeypatch.delenv("OMNISTAGE_CUDA_GRAPHS", raising=False)
    assert decode_graphs.selected(cuda, uses_triton=True, enforce_eager=False)
    assert not decode_graphs.selected(cuda, uses_triton=True, enforce_eager=True)
    assert not decode_graphs.selected(cuda, uses_triton=False, enforce_eager=False)  # torch path: not capturable
    assert not decode_graphs.selected(cpu, uses_triton=True, enforce_eager=False)
    monkeypatch.setenv("OMNISTAGE_CUDA_GRAPHS", "0")
    assert not decode_graphs.selected(cuda, uses_triton=True, enforce_eager=False)
    monkeypatch.setenv("OMNISTAGE_CUDA_GRAPHS", "1")
    assert decode_graphs.selected(cpu, uses_triton=True, enforce_eager=False)
    assert not decode_graphs.selected(cuda, uses_triton=True, enforce_eager=True)  # the config wins
    assert decode_graphs.batch_sizes(1) == [1]
    assert decode_graphs.batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert decode_graphs.batch_sizes(256)[-3:] == [240, 248, 256]
    # split-K: past 1024 tokens, while fewer than 256 (sequence, KV head) programs would run
    assert decode_graphs.split_counts(1, 2, 512) == [1]
    assert decode_graphs.split_counts(1, 2, 4096) == [1, 2, 4]
    assert decode_graphs.split_counts(1, 2, 32768) == [1, 2, 4, 8, 16]
    assert decode_graphs.split_counts(128, 2, 32768) == [1]
    with pytest.raises(ValueError, match="cuda_graph_max_batch"):
        EngineConfig(model_path="x", cuda_graph_max_batch=0)
