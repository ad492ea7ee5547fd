"""LLMEngine: requests in, one batched forward per step, tokens (and hidden states) out.

engine = LLMEngine(EngineConfig(model_path=...))
engine.add_request("r1", [1, 2, 3], SamplingParams(temperature=0, max_tokens=8))
while engine.has_unfinished_requests():
    for out in engine.step(): ...

A step reads schedule -> run -> postprocess: the Scheduler picks the sequences and their
token counts, the ModelRunner lays them out as one flat batch, runs the forward and samples,
and the engine advances the sequences (prefix-cache blocks, forks of n > 1, stops) and
builds the outputs. Request checks live in requests.py.
"""

from __future__ import annotations

import itertools

import torch

from omnistage.errors import InvalidRequestError
from omnistage.kernels import triton as triton_kernels
from omnistage.stages.ar import decode_graphs
from omnistage.stages.ar.config import EngineConfig, SamplingParams, load_model_config
from omnistage.stages.ar.decode_buffer import DecodeBuffer
from omnistage.stages.ar.kv_cache import BlockManager, KVCache
from omnistage.stages.ar.loader import load_model
from omnistage.stages.ar.model_runner import FlatBatch, ModelRunner
from omnistage.stages.ar.requests import RequestChecker
from omnistage.stages.ar.sampler import Sampler
from omnistage.stages.ar.scheduler import Scheduler
from omnistage.stages.ar.sequence import RequestOutput, Sequence, SequenceOptions, SequenceStatus

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
        # The Triton attention kernels read the paged cache directly: no decode buffer then.
        self.uses_triton = triton_kernels.selected(self.device)
        if config.decode_buffer_bytes > 0 and not self.uses_triton:
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
        self.graphs = self._decode_graphs()
        self.runner = ModelRunner(
            self.model,
            self.kv_cache,
            self.decode_buffer,
            self.sampler,
            block_size=bs,
            dtype=config.dtype,
            device=self.device,
            uses_mrope=mc.uses_mrope,
            num_layers=mc.num_layers,
            capture_layers=self.capture_layers,
            paged_kernels=self.uses_triton,
            kv_heads=mc.num_kv_heads,
            graphs=self.graphs,
        )
        self.checker = RequestChecker(mc, self.max_model_len, self.device, config.dtype)
        self.requests: dict[str, list[Sequence]] = {}
        self._arrival = itertools.count()
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        self._num_steps = 0
        self._generated_tokens = 0
        self._computed_tokens = 0  # tokens fed through the model (recomputes after preemption count again)

    def _decode_graphs(self) -> decode_graphs.DecodeGraphs | None:
        """Decode steps replayed from CUDA graphs (decode_graphs.py), when selected."""
        config, mc = self.config, self.model_config
        if not decode_graphs.selected(self.device, self.uses_triton, config.enforce_eager):
            return None
        graphs = decode_graphs.DecodeGraphs(
            self.model,
            self.kv_cache.layers,
            max_batch=min(config.max_num_seqs, config.cuda_graph_max_batch),
            max_model_len=self.max_model_len,
            block_size=config.block_size,
            kv_heads=mc.num_kv_heads,
            uses_mrope=mc.uses_mrope,
            capture_layers=self.capture_layers,
            outputs_only=mc.num_layers not in self.capture_layers,
            dtype=config.dtype,
        )
        if self.device.type == "cuda":  # not on first use: a capture mid-stream is a stall
            graphs.capture_all(with_extra=mc.input_projection is not None)
        return graphs

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
        options: SequenceOptions | None = None,
    ) -> None:
        """Queue a request. Raises InvalidRequestError (and queues nothing) when it is malformed.

        decode_embeds [K, embedding_size]: row min(t, K - 1) is added to the input embedding of
        generated token t when it is fed back (before any input projection); more rows can be
        appended while the request runs with `extend_decode_embeds`. options: per-request engine
        settings beyond sampling (prefix-cache keys, penalty ids, suppressed ids)."""
        if request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}", param="request_id")
        req = self.checker.check(prompt_token_ids, sampling, inputs_embeds, position_ids, decode_embeds)
        arrival = next(self._arrival)
        seqs = []
        for i in range(req.sampling.n):
            gen = None
            if req.sampling.seed is not None:
                gen = torch.Generator().manual_seed(req.sampling.seed + i)
            seqs.append(
                Sequence(
                    request_id=request_id,
                    index=i,
                    token_ids=list(req.token_ids),
                    num_prompt_tokens=req.num_prompt_tokens,
                    sampling=req.sampling,
                    arrival=arrival,
                    seq_id=next(self._seq_ids),
                    priority=priority,
                    cache_salt=cache_salt,
                    prompt_embeds=req.prompt_embeds,
                    mrope_positions=req.mrope_positions,
                    mrope_delta=req.mrope_delta,
                    decode_embeds=req.decode_embeds,
                    generator=gen,
                    **vars(options or SequenceOptions()),
                )
            )
        parent = seqs[0]
        for child in seqs[1:]:
            child.fork_parent = parent
            parent.fork_children.append(child)
        self.requests[request_id] = seqs
        self.scheduler.add(parent)

    def extend_decode_embeds(self, request_id: str, rows: torch.Tensor) -> None:
        """Append rows to every live sequence of the request's decode_embeds."""
        rows = self.checker.embedding_rows(rows, "decode_embeds", "rows")
        for seq in self.requests.get(request_id, ()):
            seq.decode_embeds = rows if seq.decode_embeds is None else torch.cat((seq.decode_embeds, rows))

    def set_decode_embeds_open(self, request_id: str, is_open: bool) -> None:
        """Whether more decode_embeds rows will come for the request (see Sequence)."""
        for seq in self.requests.get(request_id, ()):
            seq.decode_embeds_open = is_open

    def hold_request(self, request_id: str, held: bool) -> None:
        """Hold a request's sequences back (or let them go on) without freeing their blocks."""
        for seq in self.requests.get(request_id, ()):
            seq.held = held

    def has_runnable_requests(self) -> bool:
        """step() would make progress now (not every sequence is held or awaiting rows)."""
        return bool(self._pending) or self.scheduler.has_runnable()

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
            "computed_tokens": self._computed_tokens,
            "max_model_len": self.max_model_len,
            "decode_buffer_rebuilds": self.decode_buffer.num_rebuilds if self.decode_buffer else 0,
            "decode_buffer_joins": self.decode_buffer.num_joins if self.decode_buffer else 0,
            "decode_graphs_captured": self.graphs.num_captured if self.graphs else 0,
            "decode_graph_replays": self.graphs.num_replays if self.graphs else 0,
        }

    # ---------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if batch.empty:
            return outputs
        self._num_steps += 1
        flat = self.runner.prepare(batch.seqs, batch.num_new_tokens)
        hidden, captured = self.runner.forward(flat)
        sample_seqs, sample_rows, row_start = self._advance(flat)
        new_tokens = self.runner.sample(hidden, flat, sample_seqs, sample_rows)
        outputs.extend(self._postprocess(flat, sample_seqs, new_tokens, captured, row_start))
        return outputs

    def _advance(self, flat: FlatBatch) -> tuple[list[Sequence], list[int], dict[int, tuple[int, int]]]:
        """Count the batch's tokens as computed; the sequences that reached their last known
        token (and the n > 1 siblings forked off a finished prompt) are sampled, each from
        the flat row returned beside it."""
        sample_seqs: list[Sequence] = []
        sample_rows: list[int] = []
        row_start: dict[int, tuple[int, int]] = {}
        r = 0
        for seq, n in flat.ordered:
            row_start[id(seq)] = (r, n)
            seq.num_computed_tokens += n
            self._computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                sample_seqs.append(seq)
                sample_rows.append(r + n - 1)
                for child in seq.fork_children:
                    self._fork(seq, child)
                    sample_seqs.append(child)
                    sample_rows.append(r + n - 1)
                seq.fork_children = []
            r += n
        return sample_seqs, sample_rows, row_start

    def _postprocess(
        self,
        flat: FlatBatch,
        sample_seqs: list[Sequence],
        new_tokens: dict[int, tuple[int, dict | None]],
        captured: dict,
        row_start: dict[int, tuple[int, int]],
    ) -> list[RequestOutput]:
        """Append the sampled tokens, finish sequences that stop, and report tokens and
        captured hidden-state rows."""
        outputs = []
        for seq in list(sample_seqs) + [s for s, _ in flat.ordered if id(s) not in new_tokens]:
            if seq.is_finished:
                continue
            hs = self._new_hidden_rows(seq, captured, row_start)
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
    def _new_hidden_rows(self, seq: Sequence, captured: dict, row_start: dict) -> dict[int, torch.Tensor] | None:
        """The captured rows of positions seq has not reported yet (a sequence recomputed after
        a preemption goes over positions it already reported)."""
        if not self.capture_layers or id(seq) not in row_start:
            return None
        a, n = row_start[id(seq)]
        first = seq.num_computed_tokens - n  # position of the step's first row
        skip = max(0, seq.num_hidden_reported - first)
        if skip >= n:
            return None
        seq.num_hidden_reported = first + n
        return {i: captured[i % (self.num_layers + 1)][a + skip : a + n].clone() for i in self._requested_layers}

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
