"""LLMEngine: requests in, one batched forward per step, tokens (and hidden states) out.

engine = LLMEngine(EngineConfig(model_path=...))
engine.add_request("r1", [1, 2, 3], SamplingParams(temperature=0, max_tokens=8))
while engine.has_unfinished_requests():
    for out in engine.step(): ...
"""

from __future__ import annotations

import itertools

import torch

from omnistage.errors import InvalidRequestError
from omnistage.stages.ar.attention import DecodeBuffer, build_metadata
from omnistage.stages.ar.config import EngineConfig, SamplingParams, load_model_config
from omnistage.stages.ar.kv_cache import BlockManager, KVCache
from omnistage.stages.ar.loader import load_model
from omnistage.stages.ar.sampler import Sampler
from omnistage.stages.ar.scheduler import Scheduler
from omnistage.stages.ar.sequence import RequestOutput, Sequence, SequenceStatus

_DEFAULT_POOL_CAP_BYTES = 1 << 30


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.model_config = load_model_config(config.model_path, config.hf_config_key, config.weight_prefix)
        mc = self.model_config
        self.model = load_model(
            mc, config.model_path, config.dtype, self.device, config.weight_prefix, config.show_progress
        )
        self.num_layers = mc.num_layers
        self.capture_layers = tuple(sorted({i % (mc.num_layers + 1) for i in config.hidden_state_layers}))
        for i in config.hidden_state_layers:
            if not -(mc.num_layers + 1) <= i <= mc.num_layers:
                raise ValueError(f"hidden_state_layers: {i} out of range for {mc.num_layers} layers")
        self._requested_layers = tuple(config.hidden_state_layers)

        bs = config.block_size
        per_block = KVCache.bytes_per_block(mc.num_layers, bs, mc.num_kv_heads, mc.head_dim, config.dtype)
        want_len = config.max_model_len or mc.max_position_embeddings
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        elif config.kv_cache_bytes is not None:
            num_blocks = config.kv_cache_bytes // per_block
        else:
            num_blocks = min(_DEFAULT_POOL_CAP_BYTES // per_block, -(-want_len // bs) * config.max_num_seqs)
        if num_blocks < 1:
            raise ValueError("KV pool too small: not even one block")
        self.max_model_len = min(want_len, num_blocks * bs)
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        self.kv_cache = KVCache(mc.num_layers, num_blocks, bs, mc.num_kv_heads, mc.head_dim, config.dtype, self.device)
        self.decode_buffer = None
        if config.decode_buffer_bytes > 0:
            self.decode_buffer = DecodeBuffer(
                mc.num_layers,
                mc.num_kv_heads,
                mc.head_dim,
                bs,
                config.dtype,
                self.device,
                max_bytes=config.decode_buffer_bytes,
                max_len=self.max_model_len,
            )
            self.decode_buffer.reserve(config.max_num_seqs, self.max_model_len)
        self._seq_ids = itertools.count()
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs)
        eos = config.eos_token_ids if config.eos_token_ids is not None else mc.eos_token_ids
        self.sampler = Sampler(tuple(eos))
        self.requests: dict[str, list[Sequence]] = {}
        self._arrival = itertools.count()
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        self._num_steps = 0
        self._generated_tokens = 0

    # ---------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int] | None,
        sampling: SamplingParams | dict | None = None,
        *,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        decode_embeds: torch.Tensor | None = None,
    ) -> None:
        """Queue a request. Raises InvalidRequestError (and queues nothing) when it is malformed.

        decode_embeds [K, embedding_size]: row min(t, K - 1) is added to the input embedding of
        generated token t when it is fed back (before any input projection); more rows can be
        appended while the request runs with `extend_decode_embeds`."""
        if request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}", param="request_id")
        if sampling is None:
            sampling = SamplingParams()
        elif isinstance(sampling, dict):
            sampling = SamplingParams.from_dict(sampling)
        else:
            sampling.validate()
        mc = self.model_config
        embeds = None
        if inputs_embeds is not None:
            embeds = inputs_embeds.detach()
            if embeds.dim() == 3 and embeds.shape[0] == 1:
                embeds = embeds[0]
            if embeds.dim() != 2 or embeds.shape[1] != mc.embedding_size or embeds.shape[0] < 1:
                raise InvalidRequestError(
                    f"inputs_embeds must be [num_tokens, {mc.embedding_size}], got {tuple(inputs_embeds.shape)}",
                    param="inputs_embeds",
                )
            num_prompt = embeds.shape[0]
            embeds = embeds.to(device=self.device, dtype=self.config.dtype)
            if prompt_token_ids is not None and len(prompt_token_ids) != num_prompt:
                raise InvalidRequestError("prompt_token_ids and inputs_embeds differ in length", param="prompt")
            token_ids = [0] * num_prompt
        else:
            if not prompt_token_ids:
                raise InvalidRequestError("empty prompt", param="prompt")
            token_ids = list(map(int, prompt_token_ids))
            if min(token_ids) < 0 or max(token_ids) >= mc.vocab_size:
                raise InvalidRequestError(f"token id out of range [0, {mc.vocab_size})", param="prompt")
            num_prompt = len(token_ids)
        if num_prompt + 1 > self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {num_prompt} tokens; this model's context is {self.max_model_len} tokens "
                f"(the prompt plus at least one generated token must fit)",
                param="prompt",
            )
        mrope, delta = None, 0
        if position_ids is not None:
            if not mc.uses_mrope:
                raise InvalidRequestError("position_ids are only accepted for M-RoPE models", param="position_ids")
            pos = position_ids.detach().to("cpu", torch.long)
            if pos.dim() == 3 and pos.shape[1] == 1:
                pos = pos[:, 0]
            if pos.shape != (3, num_prompt):
                raise InvalidRequestError(
                    f"position_ids must be (3, {num_prompt}), got {tuple(position_ids.shape)}", param="position_ids"
                )
            mrope, delta = pos, int(pos.max()) + 1 - num_prompt
        extra = self._check_decode_embeds(decode_embeds)
        arrival = next(self._arrival)
        seqs = []
        for i in range(sampling.n):
            gen = None
            if sampling.seed is not None:
                gen = torch.Generator().manual_seed(sampling.seed + i)
            seqs.append(
                Sequence(
                    request_id=request_id,
                    index=i,
                    token_ids=list(token_ids),
                    num_prompt_tokens=num_prompt,
                    sampling=sampling,
                    arrival=arrival,
                    seq_id=next(self._seq_ids),
                    priority=priority,
                    cache_salt=cache_salt,
                    prompt_embeds=embeds,
                    mrope_positions=mrope,
                    mrope_delta=delta,
                    decode_embeds=extra,
                    generator=gen,
                )
            )
        parent = seqs[0]
        for child in seqs[1:]:
            child.fork_parent = parent
            parent.fork_children.append(child)
        self.requests[request_id] = seqs
        self.scheduler.add(parent)

    def _check_decode_embeds(self, rows: torch.Tensor | None) -> torch.Tensor | None:
        if rows is None:
            return None
        rows = rows.detach()
        if rows.dim() == 3 and rows.shape[0] == 1:
            rows = rows[0]
        e = self.model_config.embedding_size
        if rows.dim() != 2 or rows.shape[1] != e or rows.shape[0] < 1:
            raise InvalidRequestError(
                f"decode_embeds must be [rows, {e}], got {tuple(rows.shape)}", param="decode_embeds"
            )
        return rows.to(device=self.device, dtype=self.config.dtype)

    def extend_decode_embeds(self, request_id: str, rows: torch.Tensor) -> None:
        """Append rows to every live sequence of the request's decode_embeds."""
        rows = self._check_decode_embeds(rows)
        for seq in self.requests.get(request_id, ()):
            seq.decode_embeds = rows if seq.decode_embeds is None else torch.cat((seq.decode_embeds, rows))

    def abort_request(self, request_id: str) -> None:
        """Stop a request; its sequences report finish_reason "abort" on the next step()."""
        seqs = self.requests.pop(request_id, None)
        if not seqs:
            return
        for seq in seqs:
            if seq.is_finished:
                continue
            self.scheduler.remove(seq)
            self._finish(seq, "abort", free=False)
            self._pending.append(self._output(seq, [], None, None))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_blocks

    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "prefix_cache_hit_tokens": bm.hit_tokens,
            "prefix_cache_query_tokens": bm.query_tokens,
            "preemptions": self.scheduler.num_preemptions,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_free": bm.num_free_blocks,
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_cached": len(bm.hash_to_block),
            "steps": self._num_steps,
            "generated_tokens": self._generated_tokens,
            "max_model_len": self.max_model_len,
            "decode_buffer_rebuilds": self.decode_buffer.num_rebuilds if self.decode_buffer else 0,
        }

    # ---------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if batch.empty:
            return outputs
        self._num_steps += 1
        bs = self.config.block_size

        # Decodes (one new token) first, sorted by context length; then prefill chunks.
        items = list(zip(batch.seqs, batch.num_new_tokens))
        decodes = sorted((it for it in items if it[1] == 1), key=lambda it: it[0].num_computed_tokens)
        prefills = [it for it in items if it[1] > 1]
        ordered = decodes + prefills

        input_ids: list[int] = []
        pos_parts: list[torch.Tensor] = []
        slot_parts: list[torch.Tensor] = []
        embed_rows: list[torch.Tensor] = []
        embed_vals: list[torch.Tensor] = []
        extra_rows: list[torch.Tensor] = []
        extra_vals: list[torch.Tensor] = []
        use_mrope = self.model_config.uses_mrope
        row = 0
        dec_tables, dec_lens = [], []
        dec_keys = [seq.seq_id for seq, _ in decodes]
        if decodes:
            dec_pos = []
            dec_slots = []
            for seq, _ in decodes:
                c = seq.num_computed_tokens
                input_ids.append(seq.token_ids[c])
                dec_slots.append(seq.block_table[c // bs] * bs + c % bs)
                dec_tables.append(seq.block_table)
                dec_lens.append(c + 1)
                dec_pos.append(self._positions(seq, c, 1) if use_mrope else c)
                if seq.prompt_embeds is not None and c < seq.num_prompt_tokens:
                    embed_rows.append(torch.tensor([row]))
                    embed_vals.append(seq.prompt_embeds[c : c + 1])
                if seq.decode_embeds is not None:
                    self._add_decode_embeds(seq, c, 1, row, extra_rows, extra_vals)
                row += 1
            slot_parts.append(torch.tensor(dec_slots, dtype=torch.long))
            pos_parts.append(torch.cat(dec_pos, dim=1) if use_mrope else torch.tensor(dec_pos, dtype=torch.long))
        prefill_specs = []
        offsets = torch.arange(bs, dtype=torch.long)
        for seq, n in prefills:
            c = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[c : c + n])
            table = torch.tensor(seq.block_table, dtype=torch.long)
            slot_parts.append((table.unsqueeze(1) * bs + offsets).flatten()[c : c + n])
            pos_parts.append(self._positions(seq, c, n) if use_mrope else torch.arange(c, c + n))
            if seq.prompt_embeds is not None and c < seq.num_prompt_tokens:
                m = min(c + n, seq.num_prompt_tokens) - c
                embed_rows.append(torch.arange(row, row + m))
                embed_vals.append(seq.prompt_embeds[c : c + m])
            if seq.decode_embeds is not None:
                self._add_decode_embeds(seq, c, n, row, extra_rows, extra_vals)
            prefill_specs.append((c, n, seq.block_table))
            row += n

        dev = self.device
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=dev)
        positions = torch.cat(pos_parts, dim=-1).to(dev)
        needs_output = [seq.num_computed_tokens + n == seq.num_tokens for seq, n in prefills]
        meta = build_metadata(
            dec_keys,
            dec_tables,
            dec_lens,
            prefill_specs,
            torch.cat(slot_parts),
            bs,
            dev,
            self.decode_buffer,
            prefill_needs_output=needs_output,
            dtype=self.config.dtype,
        )
        outputs_only = self.num_layers not in self.capture_layers
        embeds = torch.cat(embed_vals) if embed_vals else None
        rows_t = torch.cat(embed_rows).to(dev) if embed_rows else None
        extra = torch.cat(extra_vals) if extra_vals else None
        extra_rows_t = torch.cat(extra_rows).to(dev) if extra_rows else None
        hidden, captured = self.model(
            ids_t,
            positions,
            self.kv_cache.layers,
            meta,
            embeds,
            rows_t,
            self.capture_layers,
            outputs_only,
            extra,
            extra_rows_t,
        )
        # Row of `hidden` holding flat batch row r.
        hidden_row = {r: i for i, r in enumerate(meta.out_rows.tolist())} if outputs_only else None

        # Rows whose sequence reaches its last known token produce logits and a new token.
        sample_seqs: list[Sequence] = []
        sample_rows: list[int] = []
        row_start: dict[int, tuple[int, int]] = {}
        r = 0
        for seq, n in ordered:
            row_start[id(seq)] = (r, n)
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                sample_seqs.append(seq)
                sample_rows.append(r + n - 1)
                # n > 1: the siblings fork off the parent once its prompt is computed.
                for child in seq.fork_children:
                    self._fork(seq, child)
                    sample_seqs.append(child)
                    sample_rows.append(r + n - 1)
                seq.fork_children = []
            r += n

        new_tokens: dict[int, tuple[int, dict | None]] = {}
        if sample_seqs:
            if hidden_row is not None:
                sample_rows = [hidden_row[r] for r in sample_rows]
            idx = torch.tensor(sample_rows, device=dev)
            logits = self.model.compute_logits(hidden[idx]).cpu()
            result = self.sampler(logits, sample_seqs)
            for seq, tok, lp in zip(sample_seqs, result.token_ids, result.logprobs):
                new_tokens[id(seq)] = (tok, lp)

        for seq in list(sample_seqs) + [s for s, _ in ordered if id(s) not in new_tokens]:
            if seq.is_finished:
                continue
            hs = None
            if self.capture_layers and id(seq) in row_start:
                a, n = row_start[id(seq)]
                hs = {i: captured[i % (self.num_layers + 1)][a : a + n].clone() for i in self._requested_layers}
            if id(seq) in new_tokens:
                tok, lp = new_tokens[id(seq)]
                seq.append_token(tok)
                self._generated_tokens += 1
                reason = self._check_stop(seq, tok)
                if reason:
                    self._finish(seq, reason)
                outputs.append(self._output(seq, [tok], [lp] if lp is not None else None, hs))
            elif hs is not None:
                outputs.append(self._output(seq, [], None, hs))
        return outputs

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _add_decode_embeds(seq: Sequence, start: int, n: int, row: int, rows: list, vals: list) -> None:
        """Generated tokens among positions [start, start + n) get their decode_embeds rows."""
        p = seq.num_prompt_tokens
        first = max(start, p)
        if first >= start + n:
            return
        t = torch.arange(first - p, start + n - p).clamp(max=seq.decode_embeds.shape[0] - 1)
        rows.append(torch.arange(row + first - start, row + n))
        vals.append(seq.decode_embeds[t.to(seq.decode_embeds.device)])

    @staticmethod
    def _positions(seq: Sequence, start: int, n: int) -> torch.Tensor:
        """(3, n) M-RoPE positions; text-only sequences use the same id on all three axes."""
        p = seq.position_of(start, start + n)
        return p.unsqueeze(0).expand(3, -1) if p.dim() == 1 else p

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        child.fork_parent = None
        child.num_cached_tokens = parent.num_cached_tokens
        if len(self.scheduler.running) >= self.config.max_num_seqs:
            self.scheduler.add(child)  # no room to run now: recomputed later (mostly prefix-cache hits)
            return
        try:
            copy = self.block_manager.fork(parent, child)
        except MemoryError:
            self.scheduler.add(child)  # no block for the partial copy: recompute it later
            return
        if copy is not None:
            self.kv_cache.copy_block(*copy)
        child.num_computed_tokens = parent.num_computed_tokens
        self.scheduler.add_running(child)

    def _check_stop(self, seq: Sequence, tok: int) -> str | None:
        sp = seq.sampling
        if seq.num_output_tokens >= sp.min_tokens and tok in self.sampler.stop_ids(seq):
            return "stop"
        if seq.num_output_tokens >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str, free: bool = True) -> None:
        if free:
            self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seqs = self.requests.get(seq.request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self.requests[seq.request_id]

    def _output(self, seq, tokens, logprobs, hidden) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            index=seq.index,
            new_token_ids=tokens,
            new_logprobs=logprobs,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=max(seq.num_cached_tokens, 0),
            hidden_states=hidden,
            num_output_tokens=seq.num_output_tokens,
        )
