"""The decode buffer: a contiguous, padded per-row copy of the decoding sequences' K/V kept
across engine steps (attention.py attends over it).

Gathering every decoding sequence's context through its block table costs a full copy of
the batch's KV per layer per step. `DecodeBuffer` avoids it: it keeps a contiguous,
padded copy [2, kv_heads, rows, L, d] of the decoding sequences' K/V (the paged cache stays
the source of truth). A step appends each sequence's new K/V to its row; a sequence that
leaves leaves a dead row, and one that joins takes a dead or unused row, filled from its
blocks. The buffer is rebuilt with one block gather, its rows sorted by context length, when
too many rows are dead, there is no row free, a row outgrows it, or joins have left the rows
so far out of length order that they need more length groups (one SDPA call each, so
padding stays small) than sorted rows would, by more than JOIN_EXTRA_GROUPS. The query heads
of one KV head play the query-length axis (GQA without repeating K/V). When the buffer would
exceed its memory cap, `plan` returns None and each step gathers instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

JOIN_EXTRA_GROUPS = 0  # SDPA calls per layer that rows joined out of length order may add before a rebuild


def additive_mask(lens: list[int], length: int, device, dtype=torch.float32) -> torch.Tensor:
    """[1, B, 1, length] float mask: 0 where position < len, -inf after (SDPA is faster with it)."""
    keep = torch.arange(length).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
    mask = torch.zeros(len(lens), length, dtype=dtype).masked_fill_(~keep, float("-inf"))
    return mask.view(1, len(lens), 1, length).to(device)


def length_mask(lens: list[int], length: int, device, dtype=torch.float32) -> torch.Tensor | None:
    """additive_mask, or None when every row attends all `length` positions."""
    return None if min(lens) == length else additive_mask(lens, length, device, dtype)


def padded_block_ids(tables: list[list[int]], lens: list[int], block_size: int, device) -> tuple[torch.Tensor, int]:
    """Each sequence's blocks covering its `lens` tokens, padded with block 0 to the longest,
    flattened [len(tables) * nb]; and the gathered length nb * block_size."""
    nb = -(-max(lens) // block_size)
    ids = [(table[: -(-n // block_size)] + [0] * nb)[:nb] for table, n in zip(tables, lens)]
    return torch.tensor(ids, dtype=torch.long).flatten().to(device), nb * block_size


def length_groups(lens: list[int], max_padding_ratio: float, min_group: int = 4) -> list[tuple[int, int]]:
    """Cut rows (roughly sorted by length) into ranges whose padded size stays under the ratio."""
    groups: list[tuple[int, int]] = []
    start, total, longest = 0, 0, 0
    for i, n in enumerate(lens):
        size = i - start
        new_longest = max(longest, n)
        if size >= min_group and new_longest * (size + 1) > max_padding_ratio * (total + n):
            groups.append((start, i))
            start, total, new_longest = i, 0, n
        total += n
        longest = new_longest
    if lens:
        groups.append((start, len(lens)))
    return groups


def _attended_lens(row_len: list[int]) -> list[int]:
    """Each buffer row's attended length; a dead row (0) takes the previous live row's (leading
    dead rows the first live row's), so it does not split a length group: it attends stale but
    finite K/V and its output is never read."""
    out, prev = [], 0
    for n in row_len:
        prev = n if n > 0 else prev
        out.append(prev)
    first = next((n for n in out if n > 0), 1)
    return [n if n > 0 else first for n in out]


@dataclass
class BufferPlan:
    """Buffer path for this step's decodes (see DecodeBuffer)."""

    buffers: list[torch.Tensor]  # per layer [2, kvh, rows_cap >= R, len_cap, d]
    token_rows: torch.Tensor  # [B] buffer row of each decode token (decode tokens are batch rows 0..B-1)
    token_pos: torch.Tensor  # [B] position of each new token in its row
    num_rows: int
    groups: list[tuple[int, int, int, torch.Tensor]]  # (row_start, row_end, L, additive mask [1, rows, 1, L])
    rebuild_block_ids: torch.Tensor | None = None  # [R * nb] when the buffer is (re)filled this step
    rebuild_len: int = 0  # nb * block_size
    join_rows: torch.Tensor | None = None  # [J] rows taken this step by sequences new to the buffer
    join_block_ids: torch.Tensor | None = None  # [J * nb] their blocks
    join_len: int = 0  # nb * block_size


class DecodeBuffer:
    """Contiguous per-row K/V copy of the decoding sequences, kept across steps."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype,
        device,
        max_bytes: int,
        max_len: int,
        headroom: int = 128,
        max_dead_fraction: float = 0.25,
    ):
        self.num_layers, self.kvh, self.d, self.block_size = num_layers, num_kv_heads, head_dim, block_size
        self.dtype, self.device = dtype, device
        self.elt = torch.empty((), dtype=dtype).element_size()
        self.max_bytes, self.max_len, self.headroom = max_bytes, max_len, headroom
        self.max_dead_fraction = max_dead_fraction
        self.buffers: list[torch.Tensor] = []
        self.row_of: dict[int, int] = {}
        self.row_len: list[int] = []
        self.capacity_len = 0
        self.num_rebuilds = 0
        self.num_joins = 0

    def reset(self) -> None:
        self.row_of, self.row_len = {}, []

    def _bytes(self, rows: int, length: int) -> int:
        """The buffer's size for `rows` rows of `length` positions, K and V of every layer."""
        return self.num_layers * 2 * self.kvh * rows * length * self.d * self.elt

    def reserve(self, rows: int, length: int) -> bool:
        """Allocate (and page in) the buffer for `rows` sequences of up to `length` tokens now,
        at engine start, so the first batches do not pay for growing it step by step. False
        when that would exceed the memory cap: the buffer then grows on demand."""
        bs = self.block_size
        length = -(-min(length, self.max_len) // bs) * bs
        if rows < 1 or length < 1:
            return False
        if self._bytes(rows, length) > self.max_bytes:
            return False
        shape = (2, self.kvh, rows, length, self.d)
        self.buffers = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.reset()
        return True

    def plan(
        self, keys: list[int], lens: list[int], tables: list[list[int]], max_padding_ratio: float
    ) -> BufferPlan | None:
        """keys: a never-reused id per decoding sequence; lens: context length incl. the new token.
        Returns None when the buffer would not fit its memory cap (the caller gathers instead)."""
        joins = self._place_joiners(keys, lens, max_padding_ratio)
        if joins is None:
            rows, rebuild_ids, rebuild_len = self._rebuild(keys, lens, tables)
            if rows is None:
                return None
            join_rows = join_ids = None
            join_len = 0
        else:
            rows = [self.row_of[k] for k in keys]
            for r, n in zip(rows, lens):
                self.row_len[r] = n
            rebuild_ids, rebuild_len = None, 0
            join_rows, join_ids, join_len = self._join_gather(joins, lens, tables)
        mask_lens = _attended_lens(self.row_len)
        groups = []
        for a, b in length_groups(mask_lens, max_padding_ratio):
            L = max(mask_lens[a:b])
            groups.append((a, b, L, length_mask(mask_lens[a:b], L, self.device, self.dtype)))
        return BufferPlan(
            buffers=self.buffers,
            token_rows=torch.tensor(rows, dtype=torch.long, device=self.device),
            token_pos=torch.tensor([n - 1 for n in lens], dtype=torch.long, device=self.device),
            num_rows=len(self.row_len),
            groups=groups,
            rebuild_block_ids=rebuild_ids,
            rebuild_len=rebuild_len,
            join_rows=join_rows,
            join_block_ids=join_ids,
            join_len=join_len,
        )

    def _place_joiners(
        self, keys: list[int], lens: list[int], max_padding_ratio: float
    ) -> list[tuple[int, int]] | None:
        """Keeps the buffer when every sequence already in it grew by exactly its new token:
        rows of sequences gone become dead, and sequences new to the buffer take dead or unused
        rows. Returns (batch index, row) per joining sequence, or None: rebuild instead (too many
        dead rows, no room, a row outgrowing the buffer's length, or none kept yet)."""
        if not self.row_len:
            return None
        joining = []
        for i, (k, n) in enumerate(zip(keys, lens)):
            if n > self.capacity_len:
                return None
            r = self.row_of.get(k)
            if r is None:
                joining.append(i)
            elif self.row_len[r] != n - 1:
                return None
        live = set(keys)
        free = [self.row_of.pop(k) for k in [k for k in self.row_of if k not in live]]
        for r in free:
            self.row_len[r] = 0  # finished / paused: a dead row until reused or rebuilt
        free = sorted(r for r, n in enumerate(self.row_len) if n == 0)
        spare = self.buffers[0].shape[2] - len(self.row_len)
        if len(joining) > len(free) + spare:
            return None
        joins = []
        for i in joining:
            if free:
                r = free.pop(0)
            else:
                r = len(self.row_len)
                self.row_len.append(0)
            self.row_of[keys[i]] = r
            joins.append((i, r))
        dead = len(self.row_len) - len(keys)
        if dead > self.max_dead_fraction * len(self.row_len):
            return None
        if joins and self._scattered(keys, lens, max_padding_ratio):
            return None  # joined out of length order: rebuild (sorts the rows again)
        self.num_joins += len(joins)
        return joins

    def _scattered(self, keys: list[int], lens: list[int], max_padding_ratio: float) -> bool:
        """Whether the rows, once every one has its new length, would need more length groups
        (SDPA calls) than the same lengths sorted, by more than JOIN_EXTRA_GROUPS."""
        row_len = list(self.row_len)
        for k, n in zip(keys, lens):
            row_len[self.row_of[k]] = n
        mask_lens = _attended_lens(row_len)
        here = len(length_groups(mask_lens, max_padding_ratio))
        return here > len(length_groups(sorted(mask_lens), max_padding_ratio)) + JOIN_EXTRA_GROUPS

    def _join_gather(
        self, joins: list[tuple[int, int]], lens: list[int], tables: list[list[int]]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """Block ids that copy each joining sequence's context into its row."""
        if not joins:
            return None, None, 0
        rows = torch.tensor([r for _, r in joins], dtype=torch.long, device=self.device)
        ids, length = padded_block_ids([tables[i] for i, _ in joins], [lens[i] for i, _ in joins],
                                       self.block_size, self.device)  # fmt: skip
        return rows, ids, length

    def _rebuild(
        self, keys: list[int], lens: list[int], tables: list[list[int]]
    ) -> tuple[list[int] | None, torch.Tensor | None, int]:
        """Rows for every decoding sequence, sorted by length, filled by one block gather: (each
        sequence's row, the block ids, the gathered length); (None, None, 0) over the memory cap."""
        bs = self.block_size
        cap = min(-(-(max(lens) + self.headroom) // bs) * bs, -(-self.max_len // bs) * bs)
        have_rows, have_len = (self.buffers[0].shape[2], self.buffers[0].shape[3]) if self.buffers else (0, 0)
        # Grow-only allocation: a fresh one is page-faulted in at first touch, which costs more than the gather.
        rows_cap, len_cap = max(have_rows, len(keys)), max(have_len, cap)
        if self._bytes(rows_cap, len_cap) > self.max_bytes:
            rows_cap, len_cap = len(keys), cap
            if self._bytes(rows_cap, len_cap) > self.max_bytes:
                self.buffers = []
                self.reset()
                return None, None, 0
        order = sorted(range(len(keys)), key=lambda i: lens[i])
        self.row_of = {keys[i]: r for r, i in enumerate(order)}
        self.row_len = [lens[i] for i in order]
        if (rows_cap, len_cap) != (have_rows, have_len):
            shape = (2, self.kvh, rows_cap, len_cap, self.d)
            # Zeros, not empty: masked positions still enter SDPA's P @ V (0 * NaN = NaN), so
            # every slot must always hold a finite value.
            self.buffers = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.capacity_len = len_cap
        ids, length = padded_block_ids([tables[i] for i in order], [lens[i] for i in order], bs, self.device)
        self.num_rebuilds += 1
        return [self.row_of[k] for k in keys], ids, length
