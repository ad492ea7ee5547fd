"""Batched sampling with per-sequence options and per-sequence seeded generators.

Order per row: min_tokens stop suppression -> repetition / presence / frequency penalties ->
(greedy: argmax) | temperature -> top-k -> top-p -> min-p -> sample. Random draws use the
exponential-race trick (argmax p / Exp(1)), each seeded row drawing from its own generator so
its tokens do not depend on the batch it shares. Logprobs are those of the raw model
distribution (log_softmax of the logits before any processing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnistage.stages.ar.sequence import Sequence


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...]):
        self.eos_token_ids = tuple(eos_token_ids)

    def stop_ids(self, seq: Sequence) -> set[int]:
        ids = set(seq.sampling.stop_token_ids)
        if not seq.sampling.ignore_eos:
            ids.update(self.eos_token_ids)
        return ids

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """logits: float32 [S, V], one row per sequence (its next-token distribution)."""
        S, V = logits.shape
        raw = logits
        want_lp = [s.sampling.logprobs is not None for s in seqs]
        logprobs_all = torch.log_softmax(raw, dim=-1) if any(want_lp) else None
        logits = self.penalized(raw, seqs)

        greedy_rows = [r for r, s in enumerate(seqs) if s.sampling.greedy]
        tokens = torch.empty(S, dtype=torch.long)
        if len(greedy_rows) == S:
            tokens = logits.max(dim=-1).indices
        elif greedy_rows:
            idx = torch.tensor(greedy_rows)
            tokens[idx] = logits[idx].max(dim=-1).indices  # max: faster than argmax on CPU
        rand_rows = [r for r, s in enumerate(seqs) if not s.sampling.greedy]
        if rand_rows:
            idx = torch.tensor(rand_rows)
            sub = [seqs[r] for r in rand_rows]
            probs = self._probs(logits[idx], sub)
            noise = torch.empty_like(probs)
            unseeded = [j for j, s in enumerate(sub) if s.generator is None]
            if unseeded:
                noise[unseeded] = torch.empty(len(unseeded), V, dtype=probs.dtype).exponential_()
            for j, s in enumerate(sub):
                if s.generator is not None:
                    noise[j].exponential_(generator=s.generator)
            tokens[idx] = (probs / noise).max(dim=-1).indices

        token_list = tokens.tolist()
        out_lp: list[dict[int, float] | None] = [None] * S
        if logprobs_all is not None:
            for r, s in enumerate(seqs):
                if not want_lp[r]:
                    continue
                row = logprobs_all[r]
                entry = {token_list[r]: float(row[token_list[r]])}
                k = s.sampling.logprobs
                if k:
                    vals, ids = row.topk(k)
                    for t, v in zip(ids.tolist(), vals.tolist()):
                        entry.setdefault(t, v)
                out_lp[r] = entry
        return SampleResult(token_list, out_lp)

    def plain_greedy(self, seqs: list[Sequence]) -> bool:
        """Every row takes the argmax of its raw logits: greedy, no logprobs, nothing that
        changes the logits (penalties, min_tokens stop suppression, suppressed ids)."""
        return all(s.sampling.greedy and s.sampling.logprobs is None and not self._changes_logits(s) for s in seqs)

    def _changes_logits(self, s: Sequence) -> bool:
        """min_tokens stop suppression, a penalty or suppressed ids apply to this row."""
        return (
            s.num_output_tokens < s.sampling.min_tokens or self._has_penalty(s.sampling) or bool(s.suppress_token_ids)
        )

    def penalized(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The logits with min_tokens stop suppression and the penalties applied (a copy when any applies)."""
        if not any(self._changes_logits(s) for s in seqs):
            return logits
        logits = logits.clone()
        V = logits.shape[1]
        for r, s in enumerate(seqs):
            if s.suppress_token_ids:
                logits[r, list(s.suppress_token_ids)] = float("-inf")
            if s.num_output_tokens < s.sampling.min_tokens:
                ids = [t for t in self.stop_ids(s) if t < V]
                if ids:
                    logits[r, ids] = float("-inf")
        self._apply_penalties(logits, seqs)
        return logits

    @staticmethod
    def _has_penalty(sp) -> bool:
        return sp.repetition_penalty != 1.0 or sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0

    def sampling_probs(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The distribution each (non-greedy) row samples from, after every processing step."""
        return self._probs(self.penalized(logits, seqs), seqs)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
        rows = [r for r, s in enumerate(seqs) if s.sampling.repetition_penalty != 1.0]
        if rows:
            # transformers' repetition penalty, every penalized row in one gather and scatter:
            # the logits of seen ids divided by the penalty where positive, else multiplied
            ids = [seqs[r].repetition_ids() for r in rows]
            lengths = torch.tensor([len(i) for i in ids])
            offsets = torch.tensor(rows, dtype=torch.long) * logits.shape[1]
            flat = torch.cat(ids) + torch.repeat_interleave(offsets, lengths)
            penalty = torch.tensor([seqs[r].sampling.repetition_penalty for r in rows], dtype=logits.dtype)
            penalty = torch.repeat_interleave(penalty, lengths)
            table = logits.view(-1)  # penalized() hands over its own contiguous copy
            vals = table[flat]
            table[flat] = torch.where(vals > 0, vals / penalty, vals * penalty)
        for r, s in enumerate(seqs):
            sp = s.sampling
            if (sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0) and s.output_counts:
                ids = torch.tensor(list(s.output_counts.keys()), dtype=torch.long)
                counts = torch.tensor(list(s.output_counts.values()), dtype=logits.dtype)
                logits[r, ids] -= sp.frequency_penalty * counts + sp.presence_penalty

    @staticmethod
    def _probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        temps = torch.tensor([s.sampling.temperature for s in seqs], dtype=logits.dtype).unsqueeze(1)
        logits = logits / temps
        top_ks = [s.sampling.top_k for s in seqs]
        if any(k > 0 for k in top_ks):
            V = logits.shape[1]
            ks = torch.tensor([k if k > 0 else V for k in top_ks]).clamp(max=V)
            kth = logits.topk(int(ks.max()), dim=-1).values.gather(1, (ks - 1).unsqueeze(1))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        top_ps = torch.tensor([s.sampling.top_p for s in seqs], dtype=logits.dtype)
        if (top_ps < 1.0).any():
            sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(dim=-1)
            # drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop_sorted = mass_before >= top_ps.unsqueeze(1)
            drop = torch.zeros_like(drop_sorted).scatter(1, sorted_idx, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        probs = logits.softmax(dim=-1)
        min_ps = torch.tensor([s.sampling.min_p for s in seqs], dtype=probs.dtype)
        if (min_ps > 0).any():
            thresh = probs.max(dim=-1, keepdim=True).values * min_ps.unsqueeze(1)
            probs = probs.masked_fill(probs < thresh, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs
