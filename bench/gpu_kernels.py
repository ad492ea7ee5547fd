"""Triton kernels on the GPU: correctness in bf16, time vs the torch path and vs the memory-
bandwidth bound, the AR engine on a ~0.5B Qwen2 (random weights) with kernels on and off, and
a DiT (SD3's architecture, random weights) forward with its adaLN norms fused and not.

    python -m omnistage.bench.gpu_kernels --out bench-results/gpu_kernels.json
    python -m omnistage.bench.gpu_kernels --dry-run      # CPU, Triton interpreter, tiny shapes

--dry-run runs every part at toy sizes on CPU tensors through TRITON_INTERPRET=1 (float32):
it checks that the script works, its numbers mean nothing. See docs/kernels.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

H200_HBM_GBPS = 4800.0


@dataclass(frozen=True)
class Shapes:
    device: str
    dtype: str
    block_size: int
    decode: tuple[tuple[int, int, int, int, int], ...]  # (batch, context, heads, kv_heads, head_dim)
    extend: tuple[int, int, int, int, int, int]  # (chunks, new tokens, cached prefix, heads, kv_heads, d)
    tokens: int  # rows for the elementwise kernels
    hidden: int
    intermediate: int
    engine_model: str  # bench.ar_common.SHAPES key
    engine_new_tokens: int
    engine_batch: int
    engine_prompt: int  # tokens per prompt
    dit: tuple[int, int, int, int, int, int]  # (batch, latent side, layers, heads, head_dim, text tokens)


GPU = Shapes(
    "cuda",
    "bfloat16",
    16,
    ((32, 2048, 14, 2, 64), (32, 2048, 32, 8, 128), (1, 16384, 14, 2, 64), (64, 1024, 14, 2, 64)),
    (4, 512, 1024, 14, 2, 64),
    8192,
    896,
    4864,
    "0.5b",
    256,
    32,
    128,
    (2, 128, 4, 24, 64, 333),  # 1024 px: 4096 latent tokens at SD3-medium's width 1536, 77 + 256 text
)
DRY = Shapes(
    "cpu", "float32", 8, ((3, 21, 4, 2, 16),), (2, 5, 9, 4, 2, 16), 6, 40, 48, "quick", 2, 1, 12, (2, 8, 1, 2, 8, 5)
)


def _time_ms(fn, device: str, reps: int) -> float:
    """Median milliseconds per call (CUDA: triton's do_bench with an L2 flush between calls)."""
    if device.startswith("cuda"):
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=reps * 10, return_mode="median"))
    fn()
    times = []
    for _ in range(max(1, reps // 50)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _entry(name: str, kernel_ms: float, torch_ms: float, nbytes: int, gbps: float) -> dict:
    bound_ms = nbytes / (gbps * 1e9) * 1e3
    return {
        "kernel": name,
        "triton_ms": round(kernel_ms, 5),
        "torch_ms": round(torch_ms, 5),
        "speedup_vs_torch": round(torch_ms / kernel_ms, 3),
        "bytes": nbytes,
        "bandwidth_bound_ms": round(bound_ms, 5),
        "fraction_of_bandwidth": round(bound_ms / kernel_ms, 3),
    }


def _paged(batch: int, lens: list[int], kvh: int, d: int, bs: int, dtype, device):
    import torch

    nb = [-(-n // bs) for n in lens]
    total = sum(nb) + 1
    kv = torch.randn(2, kvh, total * bs, d, dtype=dtype, device=device)
    perm = torch.randperm(total, device=device)
    tables = torch.zeros(batch, max(nb), dtype=torch.int32, device=device)
    used = 0
    for b, n in enumerate(nb):
        tables[b, :n] = perm[used : used + n]
        used += n
    return kv, tables


def _torch_decode(q, kv, tables, lens_list, scale, bs):
    """The engine's torch gather path: whole blocks by index_select, one masked SDPA."""
    import torch
    import torch.nn.functional as F

    B, H, d = q.shape
    kvh = kv.shape[1]
    L = tables.shape[1] * bs
    by_block = kv.view(2 * kvh, -1, bs * d)
    gathered = torch.index_select(by_block, 1, tables.flatten().long()).view(2, kvh, B, L, d)
    keep = torch.arange(L, device=q.device).unsqueeze(0) < torch.tensor(lens_list, device=q.device).unsqueeze(1)
    mask = torch.zeros(B, L, dtype=q.dtype, device=q.device).masked_fill_(~keep, float("-inf")).view(1, B, 1, L)
    qg = q.view(B, kvh, H // kvh, d).transpose(0, 1)
    return F.scaled_dot_product_attention(qg, gathered[0], gathered[1], attn_mask=mask, scale=scale)


def bench_decode(s: Shapes, gbps: float, reps: int) -> list[dict]:
    import torch

    from omnistage.kernels.triton.decode_attention import paged_decode_attention
    from omnistage.kernels.triton.metadata import split_count

    dt, dev = getattr(torch, s.dtype), s.device
    out = []
    for batch, ctx, h, kvh, d in s.decode:
        lens_list = [ctx] * batch
        kv, tables = _paged(batch, lens_list, kvh, d, s.block_size, dt, dev)
        lens = torch.tensor(lens_list, dtype=torch.int32, device=dev)
        q = torch.randn(batch, h, d, dtype=dt, device=dev)
        splits = split_count(batch, kvh, ctx)
        kernel = functools.partial(paged_decode_attention, q, kv, tables, lens, 0.1, s.block_size, splits)
        k_ms = _time_ms(kernel, dev, reps)
        t_ms = _time_ms(functools.partial(_torch_decode, q, kv, tables, lens_list, 0.1, s.block_size), dev, reps)
        nbytes = (2 * batch * ctx * kvh * d + 2 * q.numel()) * q.element_size()
        entry = _entry(f"decode_attention b{batch} ctx{ctx} h{h}/{kvh} d{d}", k_ms, t_ms, nbytes, gbps)
        entry["num_splits"] = splits
        out.append(entry)
    return out


def bench_extend(s: Shapes, gbps: float, reps: int) -> dict:
    import torch

    from omnistage.kernels.triton.extend_attention import paged_extend_attention, paged_extend_attention_ref

    chunks, n, ctx, h, kvh, d = s.extend
    dt, dev = getattr(torch, s.dtype), s.device
    kv, tables = _paged(chunks, [ctx + n] * chunks, kvh, d, s.block_size, dt, dev)
    as_t = lambda xs: torch.tensor(xs, dtype=torch.int32, device=dev)  # noqa: E731
    starts, q_lens, ctx_lens = as_t([i * n for i in range(chunks)]), as_t([n] * chunks), as_t([ctx] * chunks)
    q = torch.randn(chunks * n, h, d, dtype=dt, device=dev)
    args = (q, kv, tables, starts, q_lens, ctx_lens)
    k_ms = _time_ms(lambda: paged_extend_attention(*args, n, 0.1, s.block_size), dev, reps)
    t_ms = _time_ms(lambda: paged_extend_attention_ref(*args, 0.1, s.block_size), dev, reps)
    nbytes = (2 * chunks * (ctx + n) * kvh * d + 2 * q.numel()) * q.element_size()
    return _entry(f"extend_attention {chunks}x{n} after {ctx} h{h}/{kvh} d{d}", k_ms, t_ms, nbytes, gbps)


def bench_elementwise(s: Shapes, gbps: float, reps: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from omnistage.kernels.triton import elementwise as ew
    from omnistage.stages.ar.model import RotaryEmbedding, apply_rotary_, signed_sin

    dt, dev, n, hid, inter = getattr(torch, s.dtype), s.device, s.tokens, s.hidden, s.intermediate
    _, _, _, h, kvh, d = s.extend
    elt = torch.empty((), dtype=dt).element_size()
    x, res = torch.randn(n, hid, dtype=dt, device=dev), torch.randn(n, hid, dtype=dt, device=dev)
    w = torch.randn(hid, dtype=dt, device=dev)

    def torch_norm():  # the engine's bf16 path: residual add in place, then transformers' RMSNorm
        return w * F.rms_norm(x.add_(res).float(), (hid,), eps=1e-6).to(dt)

    qkv = torch.randn(n, (h + 2 * kvh) * d, dtype=dt, device=dev)
    qk = qkv[:, : (h + kvh) * d].view(n, h + kvh, d)
    cos, sin = RotaryEmbedding(d, 1e6, None)(torch.arange(n, device=dev), dt)
    ss = signed_sin(sin)
    gate_up = torch.randn(n, 2 * inter, dtype=dt, device=dev)
    gate, up = gate_up.split(inter, dim=-1)
    cache = torch.zeros(2, kvh, 2 * n, d, dtype=dt, device=dev)
    kv_new = torch.randn(n, 2 * kvh, d, dtype=dt, device=dev)
    slots = torch.randperm(2 * n, device=dev)[:n]
    flat = cache.view(2 * kvh, 2 * n, d)
    cases = [
        ("add_rms_norm", lambda: ew.add_rms_norm_(x, res, w, 1e-6), torch_norm, 3 * n * hid),
        ("rope_qk_inplace", lambda: ew.rope_(qk, cos, ss, signed_sin=True), lambda: apply_rotary_(qk, cos, ss),
         2 * n * (h + kvh) * d),
        ("silu_mul", lambda: ew.silu_mul(gate, up), lambda: F.silu(gate) * up, 3 * n * inter),
        ("store_kv", lambda: ew.store_kv(kv_new, slots, cache),
         lambda: flat.index_copy_(1, slots, kv_new.transpose(0, 1)), 2 * kv_new.numel()),
    ]  # fmt: skip
    out = []
    for name, kernel, reference, elements in cases:
        k_ms, t_ms = _time_ms(kernel, dev, reps), _time_ms(reference, dev, reps)
        out.append(_entry(f"{name} {n} rows", k_ms, t_ms, elements * elt, gbps))
    return out


def bench_dit(s: Shapes, gbps: float, reps: int, compile_too: bool = True) -> tuple[dict, dict]:
    """The adaLN kernel alone, and an SD3-architecture transformer's forward with diffusers'
    norms, with the fused ones, and compiled by torch.compile (same weights, same inputs)."""
    import torch
    from diffusers import SD3Transformer2DModel

    from omnistage.kernels.triton import adaln
    from omnistage.stages.diffusion.fused_norms import fuse_adaln, unfuse_adaln

    dt, dev = getattr(torch, s.dtype), s.device
    batch, side, layers, heads, head_dim, text = s.dit
    tokens, hidden = (side // 2) ** 2, heads * head_dim
    x = torch.randn(batch, tokens, hidden, dtype=dt, device=dev)
    shift, scale = (0.1 * torch.randn(batch, 6 * hidden, dtype=dt, device=dev)).chunk(6, dim=1)[:2]
    k_ms = _time_ms(lambda: adaln.ada_layer_norm(x, shift, scale, 1e-6), dev, reps)
    t_ms = _time_ms(lambda: adaln.ada_layer_norm_ref(x, shift, scale, 1e-6), dev, reps)
    elt = torch.empty((), dtype=dt).element_size()
    kernel = _entry(f"ada_layer_norm b{batch} {tokens}x{hidden}", k_ms, t_ms, 2 * x.numel() * elt, gbps)

    torch.manual_seed(0)
    joint, pooled = (4096, 2048) if dev != "cpu" else (32, 16)
    model = SD3Transformer2DModel(
        sample_size=side, patch_size=2, in_channels=16, out_channels=16, num_layers=layers,
        attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=joint,
        caption_projection_dim=hidden, pooled_projection_dim=pooled, pos_embed_max_size=side,
    ).to(dev, dt).eval()  # fmt: skip
    inputs = {
        "hidden_states": torch.randn(batch, 16, side, side, dtype=dt, device=dev),
        "encoder_hidden_states": torch.randn(batch, text, joint, dtype=dt, device=dev),
        "pooled_projections": torch.randn(batch, pooled, dtype=dt, device=dev),
        "timestep": torch.tensor([500.0] * batch, device=dev),
    }
    forward = functools.partial(model, **inputs)
    with torch.no_grad():
        plain = forward().sample
        plain_ms = _time_ms(forward, dev, max(10, reps // 10))
        swapped = fuse_adaln(model)
        fused = forward().sample
        fused_ms = _time_ms(forward, dev, max(10, reps // 10))
        unfuse_adaln(model)
        if compile_too:
            compiled, compile_s, backend = _compiled_forward(model, inputs, dev)
            compiled_out = compiled().sample
            compiled_ms = _time_ms(compiled, dev, max(10, reps // 10))
    dit = {
        "model": f"SD3Transformer2DModel {layers} layers, width {hidden}, {tokens} latent + {text} text tokens, "
        f"batch {batch}, {s.dtype}",
        "fused_norms": swapped,
        "forward_ms_diffusers_norms": round(plain_ms, 4),
        "forward_ms_fused_norms": round(fused_ms, 4),
        "speedup": round(plain_ms / fused_ms, 4),
        "max_abs_diff": (fused.float() - plain.float()).abs().max().item(),
    }
    if compile_too:
        dit |= {
            "compile_backend": backend,
            "compile_s": round(compile_s, 1),
            "forward_ms_compiled": round(compiled_ms, 4),
            "speedup_compiled": round(plain_ms / compiled_ms, 4),
            "compiled_max_abs_diff": (compiled_out.float() - plain.float()).abs().max().item(),
        }
    return kernel, dit


def _compiled_forward(model, inputs: dict, device: str):
    """torch.compile of diffusers' own model (the alternative to the fused norms), timed to its
    first output. The dry run uses the "eager" backend: it checks the plumbing, not inductor."""
    import torch

    backend = "inductor" if device.startswith("cuda") else "eager"
    compiled = torch.compile(model, backend=backend)
    forward = functools.partial(compiled, **inputs)
    t0 = time.perf_counter()
    forward()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return forward, time.perf_counter() - t0, backend


def check_correctness(s: Shapes) -> list[dict]:
    """Each kernel vs its reference at this run's dtype (bf16 on the GPU: ~3 significant digits)."""
    import torch

    from omnistage.kernels.triton import adaln
    from omnistage.kernels.triton import elementwise as ew
    from omnistage.kernels.triton.decode_attention import paged_decode_attention, paged_decode_attention_ref
    from omnistage.kernels.triton.extend_attention import paged_extend_attention, paged_extend_attention_ref

    dt, dev, bs = getattr(torch, s.dtype), s.device, s.block_size
    tol = 3e-2 if dt == torch.bfloat16 else 1e-4
    lens_list = [1, bs, bs + 1, 3 * bs + 5, 200 if dev == "cpu" else 3000]
    kv, tables = _paged(len(lens_list), lens_list, 2, 64, bs, dt, dev)
    lens = torch.tensor(lens_list, dtype=torch.int32, device=dev)
    q = torch.randn(len(lens_list), 8, 64, dtype=dt, device=dev)
    results = []

    def record(name, got, ref):
        err = (got.float() - ref.float()).abs().max().item()
        results.append({"kernel": name, "max_abs_err": err, "tolerance": tol, "ok": err <= tol})

    ref = paged_decode_attention_ref(q, kv, tables, lens, 0.125, bs)
    for splits in (1, 8):
        record(f"decode_attention splits={splits}", paged_decode_attention(q, kv, tables, lens, 0.125, bs, splits), ref)
    as_t = lambda xs: torch.tensor(xs, dtype=torch.int32, device=dev)  # noqa: E731
    q_lens, ctx = [l_ - c for l_, c in zip(lens_list, [0, 3, 1, bs, 7])], [0, 3, 1, bs, 7]
    starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    qx = torch.randn(sum(q_lens), 8, 64, dtype=dt, device=dev)
    args = (qx, kv, tables, as_t(starts), as_t(q_lens), as_t(ctx))
    record(
        "extend_attention",
        paged_extend_attention(*args, max(q_lens), 0.125, bs),
        paged_extend_attention_ref(*args, 0.125, bs),
    )
    x, w = torch.randn(33, 896, dtype=dt, device=dev), torch.randn(896, dtype=dt, device=dev)
    record("rms_norm", ew.rms_norm(x, w, 1e-6), ew.rms_norm_ref(x, w, 1e-6))
    g, u = torch.randn(33, 300, dtype=dt, device=dev), torch.randn(33, 300, dtype=dt, device=dev)
    record("silu_mul", ew.silu_mul(g, u), ew.silu_mul_ref(g, u))
    cos_t, sin_t = torch.randn(64, 64, dtype=dt, device=dev), torch.randn(64, 64, dtype=dt, device=dev)
    pos = torch.randint(0, 64, (3, 33), device=dev)
    axis = torch.tensor([i % 3 for i in range(32)] * 2, dtype=torch.int32, device=dev)
    xr = torch.randn(33, 4, 64, dtype=dt, device=dev)
    record("mrope", ew.rope_(xr.clone(), cos_t, sin_t, pos, axis), ew.rope_ref(xr, cos_t, sin_t, pos, axis))
    xa, emb = torch.randn(2, 33, 1536, dtype=dt, device=dev), 0.5 * torch.randn(2, 6 * 1536, dtype=dt, device=dev)
    shift, scale = emb.chunk(6, dim=1)[:2]
    record(
        "ada_layer_norm", adaln.ada_layer_norm(xa, shift, scale, 1e-6), adaln.ada_layer_norm_ref(xa, shift, scale, 1e-6)
    )
    return results


def _replay_ms(engine, reps: int) -> float | None:
    """Milliseconds per replay of the batch-1 decode graph alone (no host work around it)."""
    import torch

    from omnistage.stages.ar.decode_graphs import GraphKey

    graph = engine.graphs._graphs.get(GraphKey(1, 1, False)) if engine.graphs else None
    if graph is None:
        return None
    if engine.device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(graph.replay, warmup=25, rep=reps * 10, return_mode="median"))
    with torch.inference_mode():
        return _time_ms(graph.replay, "cpu", reps)


def _engine_run(checkpoint: str, s: Shapes, triton_on: bool, graphs_on: bool, reps: int) -> dict:
    """Batch-1 decode step time and a batch's output tokens/s with the kernels on or off, and
    decode replayed from CUDA graphs or not."""
    import torch

    from omnistage.stages.ar import EngineConfig, LLMEngine, SamplingParams

    os.environ["OMNISTAGE_TRITON"] = "1" if triton_on else "0"
    os.environ["OMNISTAGE_CUDA_GRAPHS"] = "1" if graphs_on else "0"
    engine = LLMEngine(
        EngineConfig(
            model_path=checkpoint, dtype=s.dtype, device=s.device, max_model_len=1024, max_num_seqs=s.engine_batch
        )
    )
    assert engine.uses_triton == triton_on and (engine.graphs is not None) == graphs_on
    sp = SamplingParams(temperature=0, max_tokens=s.engine_new_tokens, ignore_eos=True)
    engine.add_request("solo", list(range(1, s.engine_prompt + 1)), sp)
    step_ms, tokens = [], []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        for o in engine.step():
            tokens.extend(o.new_token_ids)
        step_ms.append((time.perf_counter() - t0) * 1e3)
    replay_ms = _replay_ms(engine, reps)
    t0 = time.perf_counter()
    for i in range(s.engine_batch):
        engine.add_request(f"b{i}", [(7 * i + j) % 1000 + 1 for j in range(s.engine_prompt)], sp)
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.perf_counter() - t0
    stats = engine.stats()
    del engine
    if s.device.startswith("cuda"):
        torch.cuda.empty_cache()
    decode_steps = step_ms[2:] or step_ms  # after the prefill and the first decode (warm-up)
    out = {
        "batch1_decode_step_ms": round(statistics.median(decode_steps), 4),
        "batch_output_tok_s": round(s.engine_batch * s.engine_new_tokens / wall, 1),
        "greedy_tokens": tokens,
    }
    if graphs_on:
        out["batch1_graph_replay_ms"] = None if replay_ms is None else round(replay_ms, 4)
        out["graphs_captured"] = stats["decode_graphs_captured"]
        out["graph_replays"] = stats["decode_graph_replays"]
    return out


ENGINE_VARIANTS = {"torch": (False, False), "triton": (True, False), "triton_graphs": (True, True)}


def bench_engine(s: Shapes, gbps: float, reps: int) -> dict:
    import torch

    from omnistage.bench.ar_common import SHAPES, build_bench_checkpoint

    shape = SHAPES[s.engine_model]
    if s.device == "cpu":
        from omnistage.models.tiny_llm import build_qwen2_checkpoint

        tmp = tempfile.TemporaryDirectory(prefix="gpu-kernels-dry-")
        checkpoint = Path(tmp.name)
        build_qwen2_checkpoint(
            checkpoint, vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, num_layers=shape.num_layers,
            num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, intermediate_size=shape.intermediate_size,
            eos_token_id=None, pad_token_id=0, dtype=torch.float32,
        )  # fmt: skip
    else:
        checkpoint = build_bench_checkpoint(shape, s.dtype)
    before = {k: os.environ.get(k) for k in ("OMNISTAGE_TRITON", "OMNISTAGE_CUDA_GRAPHS")}
    try:
        runs = {}
        for name, flags in ENGINE_VARIANTS.items():
            try:
                runs[name] = _engine_run(str(checkpoint), s, *flags, reps)
            except Exception as exc:  # one variant failing (a capture, say) keeps the others' figures
                runs[name] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"engine {name}: {runs[name]['error']}", file=sys.stderr, flush=True)
    finally:
        for k, v in before.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
    weight_bytes = shape.num_params() * torch.empty((), dtype=getattr(torch, s.dtype)).element_size()
    bound_ms = weight_bytes / (gbps * 1e9) * 1e3
    reference = runs["torch"].get("greedy_tokens", [])
    result = {
        "model": shape.name,
        "dtype": s.dtype,
        "weight_bytes": weight_bytes,
        "batch1_step_bound_ms": round(bound_ms, 4),
    }
    for name, run in runs.items():
        result[name] = run
        if "error" in run:
            continue
        tokens = run.pop("greedy_tokens")
        run["step_over_bound"] = round(run["batch1_decode_step_ms"] / bound_ms, 2)
        if run.get("batch1_graph_replay_ms"):
            run["replay_over_bound"] = round(run["batch1_graph_replay_ms"] / bound_ms, 2)
        if name != "torch":
            run["greedy_tokens_equal_torch"] = f"{sum(a == b for a, b in zip(tokens, reference))}/{s.engine_new_tokens}"
    return result


def _targets(result: dict) -> dict:
    """The issue's H200 targets: decode attention >= 70% of HBM bandwidth at 32 x 2k; the
    batch-1 decode step (kernels and CUDA graphs on) within 1.25x of the weight-bytes bound."""
    out = {}
    for k in result["kernels"]:
        if k["kernel"].startswith("decode_attention b32 ctx2048 h14/2"):
            out["decode_32x2k_fraction_of_bandwidth"] = k["fraction_of_bandwidth"]
            out["decode_32x2k_met"] = k["fraction_of_bandwidth"] >= 0.7
    if "engine" in result:
        graphs = result["engine"]["triton_graphs"]
        if "error" not in graphs:
            out["batch1_step_over_bound"] = graphs["step_over_bound"]
            out["batch1_step_met"] = graphs["step_over_bound"] <= 1.25
            out["batch1_replay_over_bound"] = graphs.get("replay_over_bound")  # the forward alone
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m omnistage.bench.gpu_kernels", description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, toy shapes")
    p.add_argument("--out", default="bench-results/gpu_kernels.json", help="JSON result path")
    p.add_argument("--hbm-gbps", type=float, default=H200_HBM_GBPS, help="peak memory bandwidth (GB/s)")
    p.add_argument("--reps", type=int, default=100, help="timing repetitions per kernel")
    p.add_argument("--skip-engine", action="store_true", help="no AR engine runs")
    p.add_argument("--skip-compile", action="store_true", help="no torch.compile of the DiT")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined: before their import
    s = DRY if args.dry_run else GPU
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device (use --dry-run on CPU)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    result: dict = {"dry_run": args.dry_run, "shapes": asdict(s), "hbm_gbps": args.hbm_gbps}
    result["device_name"] = torch.cuda.get_device_name() if s.device == "cuda" else "cpu (Triton interpreter)"
    result["correctness"] = check_correctness(s)
    print(f"correctness: {sum(r['ok'] for r in result['correctness'])}/{len(result['correctness'])} ok", flush=True)
    result["kernels"] = bench_decode(s, args.hbm_gbps, args.reps) + [bench_extend(s, args.hbm_gbps, args.reps)]
    result["kernels"] += bench_elementwise(s, args.hbm_gbps, args.reps)
    adaln_entry, result["dit"] = bench_dit(s, args.hbm_gbps, args.reps, compile_too=not args.skip_compile)
    result["kernels"].append(adaln_entry)
    for k in result["kernels"]:
        print(f"{k['kernel']:<48} {k['triton_ms']:>9.4f} ms  x{k['speedup_vs_torch']:<6} "
              f"{100 * k['fraction_of_bandwidth']:.0f}% of bandwidth", flush=True)  # fmt: skip
    if not args.skip_engine:
        result["engine"] = bench_engine(s, args.hbm_gbps, args.reps)
        print(json.dumps(result["engine"]), flush=True)
    print(json.dumps(result["dit"]), flush=True)
    result["targets"] = _targets(result)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} ({result['wall_s']} s)")
    failed = [name for name, run in result.get("engine", {}).items() if isinstance(run, dict) and "error" in run]
    return 0 if all(r["ok"] for r in result["correctness"]) and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
