"""The thinker's talker rows of prefix-cached positions, kept beside the KV blocks.

A spoken answer needs a talker row (embedding + last hidden state) for every prompt
position, but positions served from the prefix cache are not run, so their rows are not
computed. The thinker therefore keeps the rows of every full KV block a spoken request
computed, keyed by the same chained block hash the engine's prefix cache uses
(`kv_cache.chain_hash` over the block's cache keys and the request's salt). A later spoken
request that hits those blocks takes their rows from here. Entries whose hash the engine
no longer holds are dropped whenever the store outgrows the KV pool, so it never keeps more
blocks than the pool has.

Spoken requests hash under their own salt suffix, so they only ever hit blocks that a spoken
request computed (and whose rows are therefore here); a text-only request's blocks stay apart.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field

import torch

from omnistage.stages.ar.kv_cache import chain_hash

SPOKEN_SALT = "\0talker"


def spoken_salt(salt: str | None) -> str:
    """The cache salt of a spoken request: its own salt, kept apart from text-only requests."""
    return f"{salt or ''}{SPOKEN_SALT}"


class TalkerRowStore:
    """Block hash -> [block_size, hidden] talker rows."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.rows: dict[int, torch.Tensor] = {}

    def put(self, block_hash: int, rows: torch.Tensor, live: Container[int]) -> None:
        self.rows[block_hash] = rows
        if len(self.rows) > self.num_blocks:
            self.rows = {h: r for h, r in self.rows.items() if h in live}

    def get(self, hashes: list[int]) -> torch.Tensor:
        missing = [h for h in hashes if h not in self.rows]
        if missing:
            raise RuntimeError(f"{len(missing)} prefix-cached blocks have no talker rows")
        return torch.cat([self.rows[h] for h in hashes])


@dataclass
class BlockRows:
    """One spoken request's talker rows, hashed per full block as they arrive."""

    keys: list[int]  # the prompt's cache keys (token ids, content keys at media rows)
    salt: str
    block_size: int
    hashes: list[int] = field(default_factory=list)
    pending: list[torch.Tensor] = field(default_factory=list)  # rows after the last full block
    num_pending: int = 0
    next_block: int = 0  # the block the first pending row belongs to

    def hashes_upto(self, num_blocks: int, generated: list[int]) -> list[int]:
        keys = self.keys + generated
        bs = self.block_size
        while len(self.hashes) < num_blocks:
            i = len(self.hashes)
            parent = self.hashes[-1] if self.hashes else None
            self.hashes.append(chain_hash(parent, tuple(keys[i * bs : (i + 1) * bs]), self.salt))
        return self.hashes[:num_blocks]

    def cached(self, store: TalkerRowStore, num_cached: int) -> torch.Tensor:
        """The rows of the first num_cached positions (whole blocks), from the store."""
        self.next_block = num_cached // self.block_size
        return store.get(self.hashes_upto(self.next_block, []))

    def record(self, store: TalkerRowStore, rows: torch.Tensor, generated: list[int], live: Container[int]) -> None:
        """The next rows in position order; every block they complete goes to the store."""
        self.pending.append(rows)
        self.num_pending += rows.shape[0]
        bs = self.block_size
        if self.num_pending < bs:
            return
        flat = torch.cat(self.pending)
        full = self.num_pending // bs
        hashes = self.hashes_upto(self.next_block + full, generated)
        for j in range(full):
            store.put(hashes[self.next_block + j], flat[j * bs : (j + 1) * bs].clone(), live)
        self.next_block += full
        rest = flat[full * bs :]
        self.pending = [rest] if rest.shape[0] else []
        self.num_pending = rest.shape[0]
