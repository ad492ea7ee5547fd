"""Paged KV cache: block pool, per-sequence block tables, prefix caching.

Blocks are fixed-size (block_size token slots). A full block whose tokens are all computed is
registered under a hash chained over the whole prefix (and the request's cache_salt), so any
later sequence with the same prefix reuses it. Blocks are reference counted; a block at
refcount 0 sits in an LRU free queue and keeps its hash (still a cache hit) until the pool
needs it for something else. "Free" therefore counts cached-but-unused blocks too.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

from omnistage.stages.ar.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


def chain_hash(parent: int | None, tokens: tuple[int, ...], salt: str | None) -> int:
    """128-bit BLAKE2 of (parent hash, block tokens, salt): unlike Python's hash(), tenants cannot
    craft colliding prefixes to read each other's cached K/V."""
    h = hashlib.blake2b(digest_size=16)
    h.update((parent or 0).to_bytes(16, "little"))
    h.update(array("q", tokens).tobytes())
    if salt is not None:
        h.update(b"\x00salt:" + salt.encode())
    return int.from_bytes(h.digest(), "little")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.hit_tokens = 0
        self.query_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    # ---- prefix cache ----
    def _hashes_for(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        """Chained hashes of the first num_full_blocks blocks of seq's tokens (memoized on seq)."""
        bs = self.block_size
        hashes = seq.block_hashes
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(chain_hash(parent, tuple(seq.cache_key_ids(i * bs, (i + 1) * bs)), seq.cache_salt))
        return hashes[:num_full_blocks]

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of seq (leaving >= 1 token to compute)."""
        if not self.enable_prefix_caching or not seq.prompt_hashable:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for h in self._hashes_for(seq, max_blocks):
            b = self.hash_to_block.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.query_tokens += num_query_tokens
        self.hit_tokens += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of seq that are now full of computed tokens."""
        if not self.enable_prefix_caching or not seq.prompt_hashable:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_full <= seq.num_registered_blocks:
            return
        hashes = self._hashes_for(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None:
                continue
            h = hashes[i]
            if h in self.hash_to_block:
                continue  # same content already cached in another block; this one stays private
            block.block_hash = h
            self.hash_to_block[h] = block.block_id
        seq.num_registered_blocks = num_full

    # ---- allocation ----
    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)  # least recently used
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached content
            if self.hash_to_block.get(block.block_hash) == block_id:
                del self.hash_to_block[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def allocate(self, seq: Sequence, num_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Make seq's block table cover num_tokens tokens, first adopting cached_blocks (a prefix
        hit for a sequence with an empty table). False (and no change) when the pool is short."""
        cached_free = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        new = max(0, -(-num_tokens // self.block_size) - len(seq.block_table) - len(cached_blocks))
        if new + cached_free > self.num_free_blocks:
            return False
        for b in cached_blocks:
            self._touch(b)
        seq.block_table.extend(cached_blocks)
        for _ in range(new):
            seq.block_table.append(self._take_free_block())
        return True

    def free(self, seq: Sequence) -> None:
        # Tail blocks first so that LRU eviction takes a prefix's tail before its head.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_queue[block_id] = None
                    self.free_queue.move_to_end(block_id, last=False)  # uncached: reuse first
                else:
                    self.free_queue[block_id] = None
        seq.block_table = []
        seq.num_registered_blocks = 0

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Share parent's full blocks with child; give child a private copy slot for the partial
        last block. Returns (src, dst) block ids whose KV the caller must copy, or None.
        Raises MemoryError when no block is free for the partial copy."""
        num_full = parent.num_computed_tokens // self.block_size
        partial = parent.num_computed_tokens % self.block_size != 0
        if partial and self.num_free_blocks < 1:
            raise MemoryError("no free block to fork into")
        for b in parent.block_table[:num_full]:
            self._touch(b)
        child.block_table = list(parent.block_table[:num_full])
        if partial:
            dst = self._take_free_block()
            child.block_table.append(dst)
            return parent.block_table[num_full], dst
        return None


class KVCache:
    """The pool's tensors: one [2, kv_heads, num_blocks * block_size, head_dim] tensor per layer."""

    def __init__(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device
    ):
        self.block_size = block_size
        self.layers = [
            torch.zeros(2, num_kv_heads, num_blocks * block_size, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        for t in self.layers:
            t[:, :, dst * bs : (dst + 1) * bs] = t[:, :, src * bs : (src + 1) * bs]
