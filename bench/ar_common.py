"""Shared pieces of the AR benchmark: model shapes, the workload, statistics, peak RSS."""

from __future__ import annotations

import json
import os
import random
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        head_dim = h // self.num_heads
        kv = self.num_kv_heads * head_dim
        attn = h * h + 2 * h * kv + h * h + h + 2 * kv  # q, k, v, o (+ qkv bias)
        mlp = 3 * h * i
        per_layer = attn + mlp + 2 * h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h


SHAPES = {
    # The benchmark model: ~55M parameters.
    "55m": ModelShape("qwen2-55m", 32000, 512, 8, 8, 2, 1408),
    # --quick: small enough for the test suite.
    "quick": ModelShape("qwen2-quick", 2048, 128, 2, 4, 2, 256),
    # The GPU run: Qwen2.5-0.5B's shape.
    "0.5b": ModelShape(
        "qwen2-0.5b", 151936, 896, 24, 14, 2, 4864, tie_word_embeddings=True, max_position_embeddings=32768
    ),
}


def build_bench_checkpoint(shape: ModelShape, dtype: str = "float32") -> Path:
    """Random-weight checkpoint of `shape` (no EOS token: generation runs to max_tokens)."""
    import torch

    from omnistage.models.recipes import cache_root
    from omnistage.models.tiny_llm import build_qwen2_checkpoint

    target = cache_root() / "bench" / f"{shape.name}-{dtype}-v1"
    if (target / ".complete").exists():
        return target
    tmp = target.with_name(target.name + f".building-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    build_qwen2_checkpoint(
        tmp,
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=shape.tie_word_embeddings,
        initializer_range=0.2,
        eos_token_id=None,
        pad_token_id=0,
        dtype=getattr(torch, dtype),
    )
    (tmp / ".complete").write_text("ok\n")
    import shutil

    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    seed: int

    @property
    def requested_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab_size: int, seed: int = 0
) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
    outs = [rng.randint(*output_range) for _ in range(n)]
    return Workload(prompts, outs, seed)


@dataclass
class PrefixWorkload:
    prompts: list[list[int]]  # shared prefix + unique suffix
    prefix_len: int
    output_len: int


def make_prefix_workload(
    n: int, prefix_len: int, suffix_len: int, output_len: int, vocab_size: int, seed: int = 1
) -> PrefixWorkload:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]
    prompts = [prefix + [rng.randrange(vocab_size) for _ in range(suffix_len)] for _ in range(n)]
    return PrefixWorkload(prompts, prefix_len, output_len)


@dataclass
class RunMetrics:
    """One timed pass over the workload. Times in seconds from the pass's start."""

    wall_s: float
    output_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    def summary(self) -> dict[str, float]:
        return {
            "output_tok_s": self.tok_s,
            "output_tokens": self.output_tokens,  # received, not requested: the smoke checks it
            "wall_s": self.wall_s,
            "ttft_ms_p50": percentile(self.ttft_s, 50) * 1e3,
            "ttft_ms_p99": percentile(self.ttft_s, 99) * 1e3,
            "tpot_ms_p50": percentile(self.tpot_s, 50) * 1e3 if self.tpot_s else float("nan"),
            "tpot_ms_p99": percentile(self.tpot_s, 99) * 1e3 if self.tpot_s else float("nan"),
        }


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def tpot(first: float, last: float, n_tokens: int) -> float | None:
    return (last - first) / (n_tokens - 1) if n_tokens > 1 else None


def median_min_max(values: list[float]) -> dict[str, float | list[float]]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def aggregate(runs: list[dict[str, float]]) -> dict[str, dict]:
    return {key: median_min_max([r[key] for r in runs]) for key in runs[0]}


def tree_peak_rss_mb(pid: int | None = None) -> float:
    """Sum of peak RSS (VmHWM) of a process and all its live descendants, in MiB."""
    pid = pid or os.getpid()
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    total_kb, stack = 0, [pid]
    while stack:
        p = stack.pop()
        stack.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        total_kb += int(line.split()[1])
        except OSError:
            pass
    return total_kb / 1024


def write_json(path: str | Path, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2, default=_jsonable))


def _jsonable(obj):
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)
