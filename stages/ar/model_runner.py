"""ModelRunner: one scheduled batch -> one flat forward -> sampled tokens.

The engine decides who runs (scheduler) and what follows (stops, forks, outputs); the runner
owns the model, the KV cache and the decode buffer, and does the three things in between:

    flat = runner.prepare(batch)          the flat token batch and its attention metadata
    hidden, captured = runner.forward(flat)
    tokens = runner.sample(hidden, flat, seqs, rows)

Flat layout: decodes (one token each) first, sorted by context length, then prefill chunks;
each sequence's rows are contiguous. A decode-only step may instead be replayed from a CUDA
graph (decode_graphs.py): prepare() then plans its graph inputs and builds no metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnistage.stages.ar.attention import AttentionMetadata, build_metadata
from omnistage.stages.ar.decode_buffer import DecodeBuffer
from omnistage.stages.ar.decode_graphs import DecodeGraphs, GraphStep
from omnistage.stages.ar.kv_cache import KVCache
from omnistage.stages.ar.sampler import Sampler
from omnistage.stages.ar.sequence import Sequence


@dataclass
class FlatBatch:
    """One step's tokens laid out as a single sequence of rows."""

    ordered: list[tuple[Sequence, int]]  # (sequence, new tokens) in row order
    input_ids: torch.Tensor | None
    positions: torch.Tensor | None
    meta: AttentionMetadata | None
    graph: GraphStep | None = None  # replayed from a CUDA graph (then no ids / positions / meta)
    embeds: torch.Tensor | None = None  # prompt embeddings replacing rows `embed_rows`
    embed_rows: torch.Tensor | None = None
    extra: torch.Tensor | None = None  # decode_embeds added to rows `extra_rows`
    extra_rows: torch.Tensor | None = None
    outputs_only: bool = False  # hidden holds only the rows that produce logits
    # row of `hidden` holding flat row r (outputs_only), built on first use
    _hidden_row: dict[int, int] | None = field(default=None, repr=False)

    def hidden_index(self, rows: list[int]) -> list[int]:
        if not self.outputs_only:
            return rows
        if self._hidden_row is None:
            self._hidden_row = {r: i for i, r in enumerate(self.meta.out_rows.tolist())}
        return [self._hidden_row[r] for r in rows]


@dataclass
class _Rows:
    """Accumulates the flat batch's per-row pieces while sequences are laid out."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)
    embed_rows: list[torch.Tensor] = field(default_factory=list)
    embed_vals: list[torch.Tensor] = field(default_factory=list)
    extra_rows: list[torch.Tensor] = field(default_factory=list)
    extra_vals: list[torch.Tensor] = field(default_factory=list)
    count: int = 0

    def add_decode_embeds(self, seq: Sequence, start: int, n: int) -> None:
        """Generated tokens among positions [start, start + n) get their decode_embeds rows."""
        p = seq.num_prompt_tokens
        first = max(start, p)
        if first >= start + n:
            return
        t = torch.arange(first - p, start + n - p).clamp(max=seq.decode_embeds.shape[0] - 1)
        self.extra_rows.append(torch.arange(self.count + first - start, self.count + n))
        self.extra_vals.append(seq.decode_embeds[t.to(seq.decode_embeds.device)])


def _cat(parts: list[torch.Tensor], device: torch.device | None = None) -> torch.Tensor | None:
    if not parts:
        return None
    t = torch.cat(parts)
    return t.to(device) if device is not None else t


class ModelRunner:
    def __init__(
        self,
        model,
        kv_cache: KVCache,
        decode_buffer: DecodeBuffer | None,
        sampler: Sampler,
        *,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        uses_mrope: bool,
        num_layers: int,
        capture_layers: tuple[int, ...],
        paged_kernels: bool = False,
        kv_heads: int = 1,
        graphs: DecodeGraphs | None = None,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.decode_buffer = decode_buffer
        self.sampler = sampler
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.uses_mrope = uses_mrope
        self.capture_layers = capture_layers
        self.paged_kernels, self.kv_heads = paged_kernels, kv_heads  # Triton attention (kernels/triton)
        # Without a capture of the last layer, the model keeps only rows that produce logits.
        self.outputs_only = num_layers not in capture_layers
        self._offsets = torch.arange(block_size, dtype=torch.long)
        self.graphs = graphs

    # -- prepare ----------------------------------------------------------------------------
    def prepare(self, seqs: list[Sequence], num_new_tokens: list[int]) -> FlatBatch:
        items = list(zip(seqs, num_new_tokens))
        decodes = sorted((it for it in items if it[1] == 1), key=lambda it: it[0].num_computed_tokens)
        prefills = [it for it in items if it[1] > 1]
        if self.graphs is not None and not prefills:
            step = self.graphs.plan(decodes)
            if step is not None:
                return FlatBatch(ordered=decodes, input_ids=None, positions=None, meta=None, graph=step)
        rows = _Rows()
        dec_tables, dec_lens = self._lay_out_decodes(decodes, rows)
        prefill_specs = self._lay_out_prefills(prefills, rows)
        dev = self.device
        meta = build_metadata(
            [seq.seq_id for seq, _ in decodes],
            dec_tables,
            dec_lens,
            prefill_specs,
            torch.cat(rows.slots),
            self.block_size,
            dev,
            self.decode_buffer,
            prefill_needs_output=[seq.num_computed_tokens + n == seq.num_tokens for seq, n in prefills],
            dtype=self.dtype,
            paged_kernels=self.paged_kernels,
            kv_heads=self.kv_heads,
        )
        return FlatBatch(
            ordered=decodes + prefills,
            input_ids=torch.tensor(rows.input_ids, dtype=torch.long, device=dev),
            positions=torch.cat(rows.positions, dim=-1).to(dev),
            meta=meta,
            embeds=_cat(rows.embed_vals),
            embed_rows=_cat(rows.embed_rows, dev),
            extra=_cat(rows.extra_vals),
            extra_rows=_cat(rows.extra_rows, dev),
            outputs_only=self.outputs_only,
        )

    def _lay_out_decodes(self, decodes: list[tuple[Sequence, int]], rows: _Rows) -> tuple[list, list]:
        bs = self.block_size
        tables, lens, positions, slots = [], [], [], []
        for seq, _ in decodes:
            c = seq.num_computed_tokens
            rows.input_ids.append(seq.token_ids[c])
            slots.append(seq.block_table[c // bs] * bs + c % bs)
            tables.append(seq.block_table)
            lens.append(c + 1)
            positions.append(seq.mrope_position_of(c, c + 1) if self.uses_mrope else c)
            if seq.prompt_embeds is not None and c < seq.num_prompt_tokens:
                rows.embed_rows.append(torch.tensor([rows.count]))
                rows.embed_vals.append(seq.prompt_embeds[c : c + 1])
            if seq.decode_embeds is not None:
                rows.add_decode_embeds(seq, c, 1)
            rows.count += 1
        if decodes:
            rows.slots.append(torch.tensor(slots, dtype=torch.long))
            rows.positions.append(
                torch.cat(positions, dim=1) if self.uses_mrope else torch.tensor(positions, dtype=torch.long)
            )
        return tables, lens

    def _lay_out_prefills(self, prefills: list[tuple[Sequence, int]], rows: _Rows) -> list:
        bs = self.block_size
        specs = []
        for seq, n in prefills:
            c = seq.num_computed_tokens
            rows.input_ids.extend(seq.token_ids[c : c + n])
            table = torch.tensor(seq.block_table, dtype=torch.long)
            rows.slots.append((table.unsqueeze(1) * bs + self._offsets).flatten()[c : c + n])
            rows.positions.append(seq.mrope_position_of(c, c + n) if self.uses_mrope else torch.arange(c, c + n))
            if seq.prompt_embeds is not None and c < seq.num_prompt_tokens:
                m = min(c + n, seq.num_prompt_tokens) - c
                rows.embed_rows.append(torch.arange(rows.count, rows.count + m))
                rows.embed_vals.append(seq.prompt_embeds[c : c + m])
            if seq.decode_embeds is not None:
                rows.add_decode_embeds(seq, c, n)
            specs.append((c, n, seq.block_table))
            rows.count += n
        return specs

    # -- run --------------------------------------------------------------------------------
    def forward(self, flat: FlatBatch) -> tuple[torch.Tensor, dict]:
        """Hidden states (all rows, or only the logit rows when outputs_only) and the
        captured layers' rows."""
        if flat.graph is not None:
            return self.graphs.run(flat.graph)
        return self.model(
            flat.input_ids,
            flat.positions,
            self.kv_cache.layers,
            flat.meta,
            flat.embeds,
            flat.embed_rows,
            self.capture_layers,
            flat.outputs_only,
            flat.extra,
            flat.extra_rows,
        )

    def sample(
        self, hidden: torch.Tensor, flat: FlatBatch, seqs: list[Sequence], rows: list[int]
    ) -> dict[int, tuple[int, dict | None]]:
        """id(seq) -> (new token, its logprobs or None) for each sequence, sampled from the
        logits of flat row rows[i]."""
        if not seqs:
            return {}
        index = flat.hidden_index(rows)
        if index == list(range(len(index))):  # decode-only steps: no index tensor to copy in
            picked = hidden[: len(index)]
        else:
            picked = hidden[torch.tensor(index, device=self.device)]
        logits = self.model.compute_logits(picked)
        if self.sampler.plain_greedy(seqs):
            # argmax where the logits are: on a GPU only the ids cross to the host, not V floats a row
            tokens = logits.max(dim=-1).indices.tolist()
            return {id(seq): (tok, None) for seq, tok in zip(seqs, tokens)}
        result = self.sampler(logits.cpu(), seqs)
        return {id(seq): (tok, lp) for seq, tok, lp in zip(seqs, result.token_ids, result.logprobs)}
