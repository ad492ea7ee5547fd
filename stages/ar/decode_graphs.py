"""Decode steps replayed from captured CUDA graphs.

A batch-1 decode step of a 0.5B model reads ~1 GB of weights in ~0.2 ms on an H200, about the
time the host takes to launch its few hundred kernels one by one. So a decode-only step (no
prefill chunk, no prompt-embedding row) runs the model from a CUDA graph captured for its
batch size rounded up to a captured size (1, 2, 4, 8, 16, 24, ... up to `max_batch`); the
host only copies the step's inputs into the graph's static buffers and replays it.

Static inputs per graph: one int64 block [ids | positions (1 or 3 rows) | slots | lengths] of
the padded batch, the shared int32 block tables, and (when sequences carry decode_embeds) the
rows added to the input embeddings. Padding rows write no K/V (slot -1) and attend one cached
position; their outputs are never read. Graphs are keyed by (padded batch, split-K factor,
with extra rows). On CUDA the engine captures them all at start (every batch size with every
split-K factor its contexts can get; the rows-adding variants too for a model with an input
projection: the talker); elsewhere a key is captured the first time a step needs it. All
graphs share one memory pool.

Only the Triton path is captured: its attention reads lengths and block tables on the device,
so one graph serves every context length. The torch path's per-step shapes and masks cannot.

`OMNISTAGE_CUDA_GRAPHS`: unset or "auto": graphs on CUDA when the Triton kernels run; "0"
(off/false/no): never; "1" (on/true/yes): on any device (`enforce_eager` wins over all three),
where a CPU "graph" re-runs the captured step eagerly on its static buffers, watched for host
syncs (tests check the static-buffer path and capture safety that way).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from omnistage.kernels.triton import env_mode
from omnistage.kernels.triton import metadata as paged_metadata
from omnistage.stages.ar.attention import AttentionMetadata
from omnistage.stages.ar.sequence import Sequence


def selected(device: torch.device, uses_triton: bool, enforce_eager: bool) -> bool:
    """Whether an engine replays its decode steps from graphs (decided once, at build);
    enforce_eager wins over the environment."""
    m = env_mode("OMNISTAGE_CUDA_GRAPHS")
    if m == "off" or not uses_triton or enforce_eager:
        return False
    return m == "on" or device.type == "cuda"


def batch_sizes(max_batch: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, then every multiple of 8 up to max_batch (and max_batch)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


def split_counts(batch: int, kv_heads: int, max_len: int) -> list[int]:
    """The split-K factors decode attention can get for `batch` sequences of up to max_len."""
    lengths = [min(n, max_len) for n in range(1024, max_len + 1024, 1024)]
    return sorted({paged_metadata.split_count(batch, kv_heads, n) for n in lengths})


@dataclass(frozen=True)
class GraphKey:
    batch: int  # padded batch size
    num_splits: int  # split-K factor of decode attention (a grid dimension)
    with_extra: bool  # decode_embeds rows are added to the input embeddings


@dataclass
class GraphStep:
    """One decode step bound for a graph: its key, real batch size and host-side inputs."""

    key: GraphKey
    size: int
    packed: torch.Tensor  # [rows, key.batch] int64 (see the module doc)
    tables: torch.Tensor  # [size, blocks] int32
    extra: torch.Tensor | None  # [size, embedding_size]


class _HostSyncWatch(TorchDispatchMode):
    """Fails on ops that read a device value on the host or copy host data in (illegal while a
    CUDA graph is captured, and a value frozen into the graph if they were not)."""

    _REFUSED = {
        "aten::_local_scalar_dense": "it would sync the host",
        "aten::item": "it would sync the host",
        "aten::nonzero": "it would sync the host",
        "aten::masked_select": "it would sync the host",
        "aten::lift_fresh": "a tensor made from host data is a copy the graph would freeze",
    }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        why = self._REFUSED.get(func._schema.name)
        if why is not None:
            raise RuntimeError(f"{func._schema.name} in a captured decode step: {why}")
        return func(*args, **(kwargs or {}))


class _CapturedStep:
    """A step function run once under capture; replay re-runs the recorded kernels and returns
    the same output tensors every time (the CPU stand-in copies into them, to alias alike)."""

    def __init__(self, body: Callable[[], tuple], device: torch.device, pool) -> None:
        self.graph = None
        self.keep: object = None  # tensors the graph reads that nothing else may hold
        if device.type == "cuda":
            with torch.cuda.device(device):
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    body()  # compile the kernels, warm cuBLAS: outside the capture
                torch.cuda.current_stream(device).wait_stream(side)
                self.graph = torch.cuda.CUDAGraph()
                # thread_local: other threads of a stage worker may touch CUDA meanwhile
                with torch.cuda.graph(
                    self.graph, pool=pool, stream=torch.cuda.Stream(device), capture_error_mode="thread_local"
                ):
                    self.outputs = body()
            self.body = None  # the graph replays alone; keeping the closure would keep a cycle
        else:
            self.body = body
            with _HostSyncWatch():
                self.outputs = body()

    def replay(self) -> tuple:
        if self.graph is not None:
            self.graph.replay()
            return self.outputs
        with _HostSyncWatch():
            hidden, captured = self.body()
        first_hidden, first_captured = self.outputs
        first_hidden.copy_(hidden)
        for layer, rows in captured.items():
            first_captured[layer].copy_(rows)
        return self.outputs


class DecodeGraphs:
    def __init__(
        self,
        model,
        kv_layers: list[torch.Tensor],
        *,
        max_batch: int,
        max_model_len: int,
        block_size: int,
        kv_heads: int,
        uses_mrope: bool,
        capture_layers: tuple[int, ...],
        outputs_only: bool,
        dtype: torch.dtype,
    ):
        self.model, self.kv_layers = model, kv_layers
        self.sizes = batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.block_size, self.kv_heads = block_size, kv_heads
        self.pos_rows = 3 if uses_mrope else 1
        self.capture_layers, self.outputs_only = capture_layers, outputs_only
        # "cuda" and "cuda:0" differ as devices: take the tensors' own, or the rotary table
        # would be rebuilt (inside a capture) on the first comparison
        device = kv_layers[0].device
        self.device, self.dtype = device, dtype
        self.max_blocks = -(-max_model_len // block_size)
        # Positions stay below the rotary table _capture builds for this bound, so the step
        # never reads them on the host.
        self.position_bound = max_model_len
        self.tables = torch.zeros(self.max_batch, self.max_blocks, dtype=torch.int32, device=device)
        self.out_rows = torch.arange(self.max_batch, device=device)
        self._graphs: dict[GraphKey, _CapturedStep] = {}
        self._inputs: dict[GraphKey, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        self._pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.num_replays = 0

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    # -- host side ----------------------------------------------------------------------------
    def plan(self, decodes: list[tuple[Sequence, int]]) -> GraphStep | None:
        """The step's graph inputs, or None when it runs eagerly (more sequences than the
        largest graph, a prompt-embedding row, a position beyond the rotary table)."""
        size = len(decodes)
        if not 0 < size <= self.max_batch:
            return None
        batch = next(b for b in self.sizes if b >= size)
        bs, pad = self.block_size, batch - size
        ids, slots, lens, tables = [], [], [], []
        positions: list[list[int]] = [[] for _ in range(self.pos_rows)]
        extra: list[torch.Tensor | None] = []
        for seq, _ in decodes:
            c, p = seq.num_computed_tokens, seq.num_prompt_tokens
            if seq.prompt_embeds is not None and c < p:
                return None
            ids.append(seq.token_ids[c])
            slots.append(seq.block_table[c // bs] * bs + c % bs)
            lens.append(c + 1)
            tables.append(seq.block_table[: c // bs + 1])
            if self.pos_rows == 1:
                positions[0].append(c)
            else:
                for axis, pos in enumerate(seq.mrope_position_of(c, c + 1)[:, 0].tolist()):
                    positions[axis].append(pos)
            rows = seq.decode_embeds
            extra.append(None if rows is None or c < p else rows[min(c - p, rows.shape[0] - 1)])
        if max(max(axis) for axis in positions) >= self.position_bound:
            return None
        packed = [ids + [0] * pad, *(axis + [0] * pad for axis in positions), slots + [-1] * pad, lens + [1] * pad]
        width = max(len(t) for t in tables)
        with_extra = any(e is not None for e in extra)
        extra_rows = None
        if with_extra:
            zero = torch.zeros(self.model.config.embedding_size, dtype=self.dtype, device=self.device)
            extra_rows = torch.stack([zero if e is None else e.to(self.device, self.dtype) for e in extra])
        return GraphStep(
            key=GraphKey(batch, paged_metadata.split_count(size, self.kv_heads, max(lens)), with_extra),
            size=size,
            packed=torch.tensor(packed, dtype=torch.long),
            tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            extra=extra_rows,
        )

    def capture_all(self, with_extra: bool) -> None:
        """Capture every graph a step can need now (largest batch first, so the smaller ones
        reuse its pool memory) instead of on first use; with_extra: also the variants that add
        decode_embeds rows."""
        for batch in reversed(self.sizes):
            for splits in split_counts(batch, self.kv_heads, self.position_bound):
                for extra in (False, True) if with_extra else (False,):
                    key = GraphKey(batch, splits, extra)
                    if key not in self._graphs:
                        self._capture(key)

    # -- device side --------------------------------------------------------------------------
    def run(self, step: GraphStep) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Copy the step's inputs in and replay its graph (capturing it first when new).
        Returns the padded batch's final hidden states and captured layers (graph memory,
        valid until the next replay)."""
        key = step.key
        if key not in self._graphs:
            self._capture(key)
        packed, lens, extra = self._inputs[key]
        packed.copy_(step.packed)
        self.tables[: step.size, : step.tables.shape[1]].copy_(step.tables)
        if extra is not None:
            extra[: step.size].copy_(step.extra)
        self.num_replays += 1
        return self._graphs[key].replay()

    def _capture(self, key: GraphKey) -> None:
        n, r = key.batch, self.pos_rows
        packed = torch.zeros(r + 3, n, dtype=torch.long, device=self.device)
        packed[r + 1].fill_(-1)  # capture with padding rows only: no K/V is written
        packed[r + 2].fill_(1)
        lens = torch.ones(n, dtype=torch.int32, device=self.device)
        extra = None
        if key.with_extra:
            extra = torch.zeros(n, self.model.config.embedding_size, dtype=self.dtype, device=self.device)
        empty = paged_metadata.empty_chunks(self.device)
        meta = AttentionMetadata(slot_mapping=packed[r + 1], num_tokens=n, num_decodes=n, block_size=self.block_size)
        meta.paged = paged_metadata.PagedKernelMeta(self.tables[:n], lens, key.num_splits, empty, empty)
        meta.out_rows = self.out_rows[:n]
        positions = packed[1] if r == 1 else packed[1 : 1 + r]

        def body() -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
            lens.copy_(packed[r + 2])
            return self.model(
                packed[0],
                positions,
                self.kv_layers,
                meta,
                None,
                None,
                self.capture_layers,
                self.outputs_only,
                extra,
                self.out_rows[:n] if extra is not None else None,
                max_position=self.position_bound,
            )

        rotary = self.model.rotary
        table = rotary._table(self.position_bound, self.dtype, self.device)
        try:
            with torch.inference_mode():  # no autograd history kept alive in the graph's pool
                captured = _CapturedStep(body, self.device, self._pool)
        except Exception as exc:
            raise RuntimeError(
                f"capturing the decode graph {key} failed: {exc} (EngineConfig(enforce_eager=True) "
                "or OMNISTAGE_CUDA_GRAPHS=0 runs decode eagerly)"
            ) from exc
        if rotary._cos is not table[0]:
            raise RuntimeError("the rotary table was rebuilt inside a captured decode step")
        captured.keep = table  # a later rebuild (an eager step's larger position) cannot free it
        self._inputs[key] = (packed, lens, extra)
        self._graphs[key] = captured
