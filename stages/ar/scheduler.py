"""Continuous-batching scheduler (vLLM v1 style).

One rule: each scheduled sequence's computed tokens catch up with its known tokens, under a
per-step token budget and a cap on running sequences. A prompt longer than the remaining
budget is prefilled in chunks over several steps, in the same steps as other sequences'
decodes. Running sequences go first (in priority, then arrival order); waiting ones are
admitted FCFS (lower `priority` value first). When the pool has no block for a running
sequence, the newest / lowest-priority running sequence is preempted: its blocks are freed
(full ones stay in the prefix cache) and it is recomputed later from its tokens.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from omnistage.stages.ar.kv_cache import BlockManager
from omnistage.stages.ar.sequence import Sequence, SequenceStatus


def _order_key(seq: Sequence) -> tuple[int, int, int]:
    return (seq.priority, seq.arrival, seq.index)


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int):
        self.bm = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: list[Sequence] = []  # sorted by _order_key
        self.running: list[Sequence] = []  # sorted by _order_key
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_order_key)

    def add_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=_order_key)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence from the queues (finish or abort) and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_runnable(self) -> bool:
        """Some sequence can advance now (not all of them wait for streamed input rows)."""
        return any(not s.stalled for s in self.waiting) or any(
            s.num_tokens > s.num_computed_tokens and not s.stalled for s in self.running
        )

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def schedule(self) -> ScheduledBatch:
        out = ScheduledBatch()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0 or seq.stalled:
                i += 1
                continue
            preempted_self = False
            while not self.bm.allocate(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                if id(victim) in scheduled:  # never happens: scheduled ones precede i
                    raise RuntimeError("scheduler invariant broken")
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    preempted_self = True
                    break
            if preempted_self:
                break
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            scheduled.add(id(seq))
            budget -= n
            i += 1

        # Admit waiting sequences, unless this step already had to preempt.
        j = 0  # waiting sequences that wait for input rows are passed over, not blocking the queue
        while j < len(self.waiting) and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[j]
            if seq.stalled:
                j += 1
                continue
            if seq.fork_parent is not None:
                break  # unreachable: children are never queued before their fork
            cached: list[int] = []
            if seq.num_computed_tokens == 0:
                cached = self.bm.find_cached_prefix(seq)
            num_cached = len(cached) * self.bm.block_size
            n = min(seq.num_tokens - num_cached, budget)
            if not self.bm.allocate(seq, num_cached + n, cached):
                break
            self.waiting.pop(j)
            if seq.num_cached_tokens < 0:  # first admission counts toward prefix-cache metrics
                seq.num_cached_tokens = num_cached
                self.bm.record_query(seq.num_prompt_tokens, num_cached)
            seq.num_computed_tokens = num_cached
            self.add_running(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
        return out
