"""The rollout plane's engine: continuous batching over a paged KV cache.

Every request of a `generate` call enters one waiting queue (twinplane.rollout.scheduler). Each engine step runs
ONE forward over a flat row of tokens: the running sequences' decodes and prefill chunks of newly admitted ones
(at most `max_num_batched_tokens`), with k/v in a pool of fixed-size blocks (twinplane.rollout.kv_cache) handed
out by the block manager. A request with n samples is prefilled once and forks into n sequences sharing its
prompt blocks. Finished sequences free their blocks at once and waiting ones take their place, so a long tail
never idles the batch, and memory follows the tokens actually held, not max_new_tokens.

Samples do not depend on batching: each sample draws its uniforms from its own stream, seeded from (the call's
seed, request index, sample index). What can still differ between two runs that batch differently is the
floating point of batched matmuls (a row's logits in a forward of 3 tokens vs 300 may differ in the last bits,
so a sample whose uniform lands on a CDF boundary could flip); on CPU the tests see identical outputs.

Interface: `generate(requests, sampling) -> samples`, `submit` (the same, as a handle), `load_weights(named)`,
`checksum()`, and `pop_metrics()` / `pop_stats()` (occupancy, preemptions, KV usage, prefill/decode tokens/s since
the last call).
With `record_routing` (MoE models) every sample carries the experts each sparse layer chose for each of its
tokens (`Sample.routing`), for the trainer to replay.

Decode-only steps run from static buffers at bucketed batch sizes, captured as CUDA/HIP graphs on GPUs
(`graphs`, `graph_max_batch`; twinplane.rollout.graphs), each launched before the one before it is read back
(`run_ahead`, see `engine_step`); everything else, and every step on CPU, runs eagerly.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Iterable, Sequence

import torch

from twinplane.errors import InputError
from twinplane.model import AttentionMetadata, Transformer, load_weights
from twinplane.model.checksum import weights_checksum
from twinplane.model.memory import state_bytes_per_sequence
from twinplane.model.moe import RoutingState
from twinplane.model.transformer import cap_logits
from twinplane.platform import backends
from twinplane.rollout import graphs as decode_graphs
from twinplane.rollout.block_manager import BlockManager
from twinplane.rollout.kernels import self_check as kernel_self_check
from twinplane.rollout.kernels import use_kernels
from twinplane.rollout.kv_cache import KVCache, pool_blocks
from twinplane.rollout.paged_attention import PagedKV, flex_decode_agrees
from twinplane.rollout.prepacked import (
    MIN_PREPACKED_DIM,
    PrepackedWeight,
    lm_head,
    prepack_linears,
    repack,
    worth_prepacking,
)
from twinplane.rollout.recurrent_state import RecurrentStates, StateBlocks
from twinplane.rollout.sampling import SamplingParams, check_logprobs, policy_logprobs, sample
from twinplane.rollout.scheduler import ScheduledBatch, Scheduler
from twinplane.rollout.sequence import Sample, sample_seed
from twinplane.rollout.sequence import Sequence as Seq
from twinplane.rollout.stats import Done, EngineStats

__all__ = ["RolloutEngine", "Sample"]


class RolloutEngine:
    def __init__(self, model: Transformer, eos_token_id: int | None, pad_token_id: int = 0,
                 max_num_seqs: int = 512, seed: int = 0, kv_cache_bytes: int = 0,
                 max_num_batched_tokens: int = 4096, gpu_memory_utilization: float = 0.9,
                 record_routing: bool = False, graphs: bool = True, graph_max_batch: int = 0,
                 kernels: str = "auto", batch_invariant: bool = False, keep_pool: bool = True,
                 run_ahead: bool = True):
        """`kv_cache_bytes`: the KV pool's budget (0 = automatic, see `runtime.kv_cache_budget`);
        `record_routing`: MoE, keep each token's experts per sparse layer in its sample; `graphs`: decode steps of
        up to `graph_max_batch` sequences (0 = max_num_seqs) as captured graphs where the platform can
        (twinplane.rollout.graphs); `kernels`: auto | triton | torch, the decode path's kernels
        (`backends.rollout_kernels`, twinplane.rollout.kernels); `batch_invariant`: every GEMM through oneDNN's
        prepacked kernels (CPU fp32), whose rows do not depend on how many rows share the call (`F.linear`'s MKL
        kernels round a row differently with the number of rows on Intel CPUs, ~4e-6, enough to flip a sampled
        token). Attention is not covered: its masked padding to the step's longest context still rounds a row by
        the batch (~1e-7). Dense models without separate LoRA adapters (experts and rank-r adapters run
        `F.linear`). `keep_pool`: keep the KV pool and the decode graphs over it between calls (else `release`
        after each: an engine sharing its device with a trainer, `runtime.keep_kv_pool`). `run_ahead`: with
        decode graphs, launch each decode step before reading back the one before it, so that the host's work
        between steps (reading tokens back, stop checks, scheduling, staging) overlaps the device's (see
        `engine_step`)."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or graph_max_batch < 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1, graph_max_batch >= 0")
        self.model = model.eval().requires_grad_(False)
        self.device = model.output_weight().device
        self.kernels, _ = backends.rollout_kernels(self.device, self.dtype, kernels, check=kernel_self_check)
        use_kernels(self.model, self.kernels)  # (the reason above is doctor's)
        # CPU fp32: the GEMMs from prepacked weights (twinplane.rollout.prepacked); `head` is the LM head's packing
        packable = self.kernels == "torch" and backends.prepacked_linear_ok(self.device, self.dtype)
        if batch_invariant and not packable:
            raise InputError(f"rollout.batch_invariant: needs the CPU float32 engine (oneDNN's prepacked GEMMs), not "
                             f"{self.device.type} {str(self.dtype).removeprefix('torch.')} with {self.kernels} "
                             "kernels")
        min_dim = 1 if batch_invariant else MIN_PREPACKED_DIM
        self.prepacked = packable and prepack_linears(self.model, min_dim) > 0
        head_worth = worth_prepacking(self.model.output_weight().shape, min_dim)
        self.head = PrepackedWeight() if self.prepacked and head_worth else None
        self.record_routing = record_routing and model.config.num_experts > 0
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.keep_pool = keep_pool
        self.kv_cache_bytes, self.gpu_memory_utilization = kv_cache_bytes, gpu_memory_utilization
        self.generator = torch.Generator(self.device).manual_seed(seed)  # one draw per call: that call's seed
        self.weight_version = 0
        self.on_weights = None  # called after each weight change
        # paged attention kernel and the pool's block size (twinplane.rollout.paged_attention), passed to every forward
        self.backend, self.block_size = backends.paged_attention_backend(self.device, self.dtype, model.config.head_dim,
                                                                         self.kernels, flex_check=flex_decode_agrees,
                                                                         latent=model.config.kv_lora_rank > 0)
        # "cuda_graph" | "eager" from the platform; tests set "static" (the graph path's buffers, not captured)
        self.graph_backend = backends.decode_graph_backend(self.device, graphs)
        self.graph_max_batch = graph_max_batch or max_num_seqs
        self.warmth = decode_graphs.Warmth()  # what later captures need not redo (decode_graphs.Warmth)
        self.kv: KVCache | None = None
        self.states: RecurrentStates | None = None  # linear-attention layers' per-sequence states
        self.blocks: BlockManager | None = None
        self.decoder: decode_graphs.DecodeGraphs | None = None  # this call's static decode (None = all eager)
        self.run_ahead = run_ahead
        self._pending: tuple[decode_graphs.Launched, list[Seq]] | None = None  # a decode step not read back yet
        self.stats = EngineStats()

    @property
    def dtype(self) -> torch.dtype:
        return self.model.output_weight().dtype

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: int | None = None,
                     strict: bool = True) -> None:
        """Copied in place; `strict=False`: a subset (LoRA adapters only)."""
        load_weights(self.model, named, strict=strict)
        self.weights_loaded(self.weight_version + 1 if version is None else version)

    def weights_loaded(self, version: int) -> None:
        """New weights are in the model (copied in place, here or by a bucketed broadcast): what derives from them
        follows now, as part of the sync rather than of the next rollout (the prepacked GEMMs' copies)."""
        self._repack()
        self.weight_version = version
        if self.on_weights is not None:  # an open stream requeues what it has in flight (rollout.stream)
            self.on_weights()

    def _repack(self) -> None:
        """The prepacked GEMMs' copies (twinplane.rollout.prepacked) re-packed where a weight changed since."""
        if self.prepacked:
            repack(self.model)
        if self.head is not None:
            self.head.refresh((self.model.output_weight(),))  # (a sequence of weights: one)

    def checksum(self) -> int:
        return weights_checksum(self.model.named_parameters())

    # --- requests in, samples out -------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, requests: Sequence[Sequence[int]], sampling: SamplingParams,
                 max_new_tokens: Sequence[int] | None = None) -> list[Sample]:
        """Samples ordered request by request, `sampling.n` per request. `max_new_tokens`: per request, a cap of
        its own below `sampling.max_new_tokens` (multi-turn continuations: what is left of each sample's budget)."""
        seed, caps = call_seed(self.generator, sampling), request_caps(len(requests), sampling, max_new_tokens)
        seqs = [self.sequence(p, i, sampling, [sample_seed(seed, i, j) for j in range(sampling.n)], cap)
                for i, (p, cap) in enumerate(zip(requests, caps, strict=True))]
        return self.run(seqs)

    def submit(self, requests: Sequence[Sequence[int]], sampling: SamplingParams,
               max_new_tokens: Sequence[int] | None = None) -> Done:
        """The async interface (`handle.result()`): one process has one device, so it generates now."""
        return Done(self.generate(requests, sampling, max_new_tokens))

    def sequence(self, prompt: Sequence[int], request_index: int, sampling: SamplingParams,
                 seeds: list[int], max_new_tokens: int | None = None) -> Seq:
        """A request as the scheduler sees it: one sequence per prompt, one random stream per sample."""
        if len(prompt) == 0:
            raise ValueError(f"request {request_index}: empty prompt")
        limit = self.model.config.dynamic_rope_limit
        if limit is not None and len(prompt) + (max_new_tokens or sampling.max_new_tokens) > limit:
            raise InputError(f"request {request_index}: {len(prompt)} prompt tokens + up to "
                             f"{max_new_tokens or sampling.max_new_tokens} new ones pass the dynamic rope limit, "
                             f"max_position_embeddings={limit} (see ModelConfig.dynamic_rope_limit)")
        stops = frozenset(t for t in [self.eos_token_id, *sampling.stop_token_ids] if t is not None)
        return Seq(list(prompt), request_index, sampling, seeds, stops, max_new_tokens=max_new_tokens)

    def scheduler(self) -> Scheduler:
        """A queue over this engine's block pool (a longrope model's sequences switch factors past its pretraining
        length: see `Scheduler`)."""
        return Scheduler(self.blocks, self.max_num_seqs, self.max_num_batched_tokens,
                         self.model.longrope_limit)

    @torch.no_grad()
    def run(self, seqs: list[Seq]) -> list[Sample]:
        """Generate `seqs` (all with one SamplingParams) to completion through one queue; samples ordered by
        (request index, sample index). Every block is back in the pool afterwards."""
        if not seqs:
            return []
        sampling = seqs[0].sampling
        self._repack()  # a weight changed in place since the last call (not through load_weights) is followed
        self._allocate(seqs)
        sched = self.scheduler()
        for s in seqs:
            sched.add(s)
        done: dict[tuple[int, int], Sample] = {}
        t0 = time.perf_counter()
        try:
            while sched.has_work():
                for seq in self.engine_step(sched, sampling):
                    done[seq.request_index, seq.sample_indices[0]] = seq.to_sample(self.weight_version)
            for seq in self.flush(sched):  # (a last step run ahead: its sequences had all finished)
                done[seq.request_index, seq.sample_indices[0]] = seq.to_sample(self.weight_version)
        finally:
            self.end_steps(sched, t0)
            if not self.keep_pool:
                self.release()
        return [done[k] for k in sorted(done)]

    def engine_step(self, sched: Scheduler, sampling: SamplingParams, ahead: bool = True) -> list[Seq]:
        """One scheduled forward and its sampling, counted; returns the sequences that finished.

        With decode graphs and `run_ahead`, a decode step's tokens are read back in the next call, after that
        call has launched its own step: the next decode of every running sequence, scheduled as if none had
        stopped (`Scheduler.schedule_ahead`; the device already holds their tokens in its rows). So the device
        runs one step while the host reads back and books the one before. A sequence that did stop wastes one
        row of the step ahead (dropped when read back; its random stream is not used again, so samples do not
        change). Where the schedule could differ (a sequence waiting, a preemption, a capture) the call reads
        back first and schedules as usual. `ahead=False`: a finished sequence may go on (a tool's output is
        appended), so nothing runs ahead of it."""
        finished = []
        if self._pending is not None:
            ahead = ahead and shares_sampling(sched.running, sampling)
            batch = sched.schedule_ahead(self.decoder.max_blocks) if ahead else None
            step = None
            if batch is not None:
                if batch.copies:
                    self.kv.copy_blocks(batch.copies)
                step = self.decoder.launch(batch.seqs, sampling, ahead=True)
                if step is not None:  # (None: a capture is due; the blocks taken serve the step below)
                    self._count(batch, sched)
                    self.stats.ahead_steps += 1
            finished = self._resolve(sched)
            if step is not None:
                self._pending = step, batch.seqs
                return finished
            if not sched.has_work():
                return finished
        batch = sched.schedule()
        self._count(batch, sched)
        return finished + self._step(batch, sched, sampling)

    def _count(self, batch: ScheduledBatch, sched: Scheduler) -> None:
        self.stats.steps += 1
        self.stats.running_sum += sched.num_running
        self.stats.usage_peak = max(self.stats.usage_peak, self.blocks.num_used / self.blocks.num_blocks)
        self.stats.decode_tokens += batch.num_decodes
        self.stats.prefill_tokens += sum(batch.num_tokens) - batch.num_decodes

    def flush(self, sched: Scheduler) -> list[Seq]:
        """Read back a decode step still in flight (`engine_step`); returns the sequences it finished."""
        return [] if self._pending is None else self._resolve(sched)

    def _resolve(self, sched: Scheduler) -> list[Seq]:
        """Read back the step in flight and book its tokens: rows of sequences that stopped before it are
        dropped (they are finished, or their blocks were released)."""
        (step, seqs), self._pending = self._pending, None
        tokens, logprobs = self.decoder.finish(step)
        keep = step.current(seqs)
        if len(keep) < len(seqs):
            self.stats.decode_tokens -= len(seqs) - len(keep)
            seqs, tokens, logprobs = [seqs[i] for i in keep], [tokens[i] for i in keep], [logprobs[i] for i in keep]
        return self._take(seqs, tokens, logprobs, sched)

    def end_steps(self, sched: Scheduler, t0: float) -> None:
        """After a run of `engine_step`s since `t0` (and `flush`): the counters, a broken capture."""
        self._pending = None  # (left only by a failed step)
        self.stats.preemptions += sched.preemptions
        sched.preemptions = 0
        self.stats.seconds += time.perf_counter() - t0
        if self.decoder is not None:
            self.stats.graph_steps += self.decoder.steps
            self.stats.wait_seconds += self.decoder.wait
            self.decoder.steps, self.decoder.wait = 0, 0.0
            if self.decoder.broken:  # a capture failed (warned): stay eager
                self.graph_backend, self.decoder = "eager", None

    def release(self) -> None:
        """Drop the KV pool and the decode graphs that point at it, so that their memory can go back; the next
        call allocates and captures again. Until then the engine keeps both: a later call that fits in the pool
        replays the graphs already captured."""
        self.decoder = self.kv = self.states = None  # (`blocks` stays to inspect)

    def pop_stats(self) -> EngineStats:
        """The counters since the last call (what a remote engine hands to the driver, which merges them)."""
        s, self.stats = self.stats, EngineStats()
        return s

    def pop_metrics(self) -> dict[str, float]:
        return self.pop_stats().metrics()

    # --- internals ----------------------------------------------------------------------------------------------
    def _allocate(self, seqs: list[Seq]) -> None:
        """Size the pool for `seqs` (`allocate`)."""
        bs = self.block_size
        self.allocate(max(len(s.tokens) + s.max_new_tokens for s in seqs),
                      sum((-(-(len(s.tokens) + s.max_new_tokens) // bs) + 1) * s.width for s in seqs),
                      sum(s.width for s in seqs))

    def allocate(self, longest: int, need_all: int, limit: int) -> None:
        """Size the pool: the budget, capped at `need_all` blocks (what the sequences to come could ever hold at
        once; the longest `longest` tokens, `limit` running at most), plus, with static decode steps, one block
        reserved for their padding rows; set up the static decode."""
        cfg, bs = self.model.config, self.block_size
        mode = decode_graphs.decode_mode(self.graph_backend, self.model, self.record_routing)
        reserved = int(mode != "eager")
        states = self.states if self.states is not None and self.states.conv.dtype == self.dtype else None
        slots = max(min(limit, self.max_num_seqs), 0 if states is None else states.num_slots)  # (budgeted too)
        held = (0 if self.kv is None else self.kv.nbytes) + (0 if self.states is None else self.states.nbytes)
        usable = pool_blocks(cfg, self.device, self.dtype, bs, reserved, self.kv_cache_bytes,
                             self.gpu_memory_utilization, longest, held,
                             int(state_bytes_per_sequence(cfg, self.dtype.itemsize)) * slots)
        need_one = -(-longest // bs)
        num_blocks = min(usable, need_all)
        # The previous call's pool (kept unless released, `keep_pool`) serves when it is large enough and within
        # the budget; the block manager hands out this call's `num_blocks` of it (so the metrics and preemptions
        # do not depend on earlier calls), and its last block stays the reserved one. Zeroed like a new pool
        # (cheap on pages already mapped), so nothing of an earlier call, NaN included, is ever read.
        kept = self.kv.num_blocks if self.kv is not None and self.kv.dtype == self.dtype else -1
        if num_blocks + reserved <= kept <= usable + reserved:
            self.kv.zero_()  # in place: graphs captured over it stay valid
        else:
            self.decoder = self.kv = None  # free the old pool (and the graphs over it) before the new one exists
            self.kv = KVCache(cfg, num_blocks + reserved, bs, self.dtype, self.device)
        self.blocks = BlockManager(num_blocks, bs)  # the reserved block (the pool's last) is never handed out
        if cfg.linear_layers:  # per-sequence states, held and released with the blocks
            if states is None:
                self.states = RecurrentStates(cfg, self.dtype, self.device, slots)
            self.states.reset()
            self.blocks = StateBlocks(num_blocks, bs, self.states)
        if not reserved:
            self.decoder = None
        elif self.decoder is None or not self.decoder.serves(mode, need_one, limit):
            self.decoder = decode_graphs.DecodeGraphs(self.model, self.kv, mode, self.backend, need_one,
                                                      self.graph_max_batch, limit, self.head, self.warmth,
                                                      fused=self.kernels == "triton")
        else:  # the earlier call's static decode, and its captured graphs, serve this call too
            self.decoder.steps, self.decoder.wait = 0, 0.0

    def _step(self, batch: ScheduledBatch, sched: Scheduler, sp: SamplingParams) -> list[Seq]:
        """One forward over `batch`; sample for the sequences whose pending tokens all ran. Returns the finished."""
        if batch.copies:
            self.kv.copy_blocks(batch.copies)
        if self.states is not None:  # (before any of the batch's tokens count as computed)
            self.states.prepare(batch.seqs, [s.num_computed == 0 for s in batch.seqs])
        if self.decoder is not None and self.decoder.fits(batch) and shares_sampling(batch.seqs, sp):
            step = self.decoder.launch(batch.seqs, sp)  # None: a capture failed, the step runs eagerly below
            if step is not None:
                self._pending = step, batch.seqs
                return [] if self.run_ahead else self._resolve(sched)
        bs, dev, d = self.block_size, self.device, batch.num_decodes
        # The decodes (most rows of most steps) first, as whole lists: each runs its last token and is then ready.
        decodes = batch.seqs[:d]
        pos = [s.num_computed for s in decodes]
        ids = [s.tokens[-1] for s in decodes]
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(decodes, pos, strict=True)]
        ctx, qlens, rows, ready = [p + 1 for p in pos], [1] * d, list(range(d)), list(decodes)
        for s in decodes:
            s.num_computed += 1
        for seq, k in zip(batch.seqs[d:], batch.num_tokens[d:], strict=True):  # prefill chunks
            start, table = seq.num_computed, seq.block_table
            ids += seq.tokens[start:start + k]
            pos += range(start, start + k)
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + k)]
            seq.num_computed += k
            ctx.append(seq.num_computed)
            qlens.append(k)
            if seq.num_computed == len(seq.tokens):
                rows.append(len(ids) - 1)
                ready.append(seq)
        # The step's metadata as two host tensors (one copy each to the device); the model gets views of them.
        T, S, width = len(ids), len(qlens), max(len(s.block_table) for s in batch.seqs)
        longrope = self.model.longrope_limit is not None  # (and each token's factor set: see `Scheduler`)
        flags = [int(s.long_rope) for s, k in zip(batch.seqs, qlens, strict=True) for _ in range(k)] if longrope else []
        longs = torch.tensor(ids + pos + slots + flags).to(dev)  # [3T] (+ [T])
        tables = []
        for s in batch.seqs:
            tables += s.block_table
            if len(s.block_table) < width:
                tables += [0] * (width - len(s.block_table))
        ints = torch.tensor(ctx + list(itertools.accumulate(qlens, initial=0)) + tables, dtype=torch.int32).to(dev)
        paged = PagedKV(self.kv.k, self.kv.v, longs[2 * T:3 * T], ints[2 * S + 1:].view(S, width), ints[:S],
                        ints[S:2 * S + 1], qlens, batch.num_decodes, max(ctx), states=self.states,
                        kv_index=self.kv.index)
        meta = AttentionMetadata(longs[T:2 * T][None], window=self.model.config.sliding_window,
                                 backend=self.backend, paged=paged,
                                 rope_long=longs[3 * T:][None] > 0 if longrope else None)
        rec = RoutingState() if self.record_routing else None
        h = self.model.hidden_states(longs[:T][None], meta=meta, routing=rec)[0]  # [T, D]
        if rec is not None:  # this step's experts [T, M, k], handed to each sequence at its token positions
            chosen = rec.indices().to(torch.int16).cpu().split(qlens)
            for seq, k, route in zip(batch.seqs, qlens, chosen, strict=True):
                seq.record_routing(seq.num_computed - k, route)
        if not ready:
            return []
        if len(rows) < T:  # (in a decode-only step every token's row is sampled)
            h = h[torch.tensor(rows, device=dev)]
        logits = cap_logits(lm_head(h, self.model.output_weight(), self.head),  # [R, V]
                            self.model.config.final_logit_softcapping)
        return self._sample(logits, ready, sched)

    def _sample(self, logits: torch.Tensor, ready: list[Seq], sched: Scheduler) -> list[Seq]:
        """Sample the next token of each of `ready` from its logits row; returns the sequences that finished. Each
        sequence samples with its own `SamplingParams` (a server's requests differ): rows that share them are
        sampled together."""
        widths = [s.width for s in ready]
        forks = max(widths) > 1
        if forks:  # a prompt just prefilled: its n samples all draw from its last position
            logits = logits.repeat_interleave(torch.tensor(widths, device=logits.device), dim=0)
        # (float32 as `sample` uses them; Python's doubles rounded once, as .to(float32) would)
        u = torch.tensor([rng.random() for s in ready for rng in s.rngs], dtype=torch.float32).to(logits.device)
        first = ready[0].sampling
        keys = None if all(s.sampling is first for s in ready) else [row_key(s) for s in ready]
        top: list | None = None  # per row, the most likely (token, log-prob) pairs, where asked for
        if keys is None or len(set(keys)) == 1:
            tok, chosen, top = self._choose(logits, ready, widths, u)
        else:
            tok = torch.empty(len(u), dtype=torch.long, device=logits.device)
            chosen = torch.empty(len(u), dtype=torch.float32, device=logits.device)
            row_keys = [k for k, w in zip(keys, widths, strict=True) for _ in range(w)]
            for key in dict.fromkeys(keys):
                rows = [r for r, k in enumerate(row_keys) if k == key]
                at = torch.tensor(rows, device=logits.device)
                part = [i for i, k in enumerate(keys) if k == key]
                tok[at], chosen[at], best = self._choose(logits[at], [ready[i] for i in part],
                                                         [widths[i] for i in part], u[at])
                if best is not None:
                    top = top or [None] * len(u)
                    for r, pairs in zip(rows, best, strict=True):
                        top[r] = pairs
        # one read back to the host for both (float64 holds every token id and each fp32 log-prob exactly)
        tok, chosen = torch.stack([tok.double(), chosen.double()]).tolist()
        tok = [int(t) for t in tok]
        if forks:  # the samples of a prompt share its blocks from here on
            rows_of = []
            for seq, w in zip(ready, widths, strict=True):
                if w > 1:
                    children = seq.fork()
                    self.blocks.share(seq, w - 1)
                    i = sched.running.index(seq)
                    sched.running[i:i + 1] = children
                    rows_of += children
                else:
                    rows_of.append(seq)
            ready = rows_of
        if top is not None:
            for seq, pairs in zip(ready, top, strict=True):
                if pairs is not None:
                    seq.top.append(pairs)
        return self._take(ready, tok, chosen, sched)

    def _choose(self, logits: torch.Tensor, ready: list[Seq], widths: list[int], u: torch.Tensor):
        """Tokens [R], their policy log-probs [R] and, with `top_logprobs`, each row's most likely (token, log-prob)
        pairs (else None), for rows of sequences that share one sampling (`row_key`)."""
        sp = ready[0].sampling
        # Triton kernels: the token and its log-prob in one kernel, without the [R, V] fp32 log-probs (no top-k/p)
        fused = self.kernels == "triton" and sp.top_k == 0 and sp.top_p == 1.0 and not sp.top_logprobs
        lp = None if fused else policy_logprobs(logits, sp.temperature)  # [R, V]
        banned = rows = None
        if sp.min_new_tokens and ready[0].stop_ids:  # stop tokens are banned in the rows short of min_new_tokens
            early = [s.num_generated < sp.min_new_tokens for s in ready]
            if any(early):
                banned = _id_tensor(ready[0].stop_ids, logits.device)  # [K]
                if not all(early):  # [R] (None: all of them)
                    rows = torch.tensor([e for e, w in zip(early, widths, strict=True) for _ in range(w)],
                                        device=logits.device)
        if fused:
            from twinplane.rollout.kernels.sampler import sample_tokens  # (imports Triton)

            return *sample_tokens(logits, sp.temperature, u, banned, rows), None  # [R], [R]
        tok = sample(lp, sp, u, banned, rows)  # [R]
        best = None
        if sp.top_logprobs:
            values, ids = lp.topk(min(sp.top_logprobs, lp.shape[-1]), dim=-1)  # [R, k]
            best = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
        return tok, lp.gather(-1, tok[:, None]).squeeze(-1), best

    def _take(self, ready: list[Seq], tokens: list[int], logprobs: list[float], sched: Scheduler) -> list[Seq]:
        """Append each sampled token with its log-prob; returns the sequences that finished (out of the batch)."""
        check_logprobs(logprobs, "rollout")
        finished, version = [], self.weight_version
        for seq, t, logprob in zip(ready, tokens, logprobs, strict=True):
            seq.append(t, logprob, version)
            if seq.finish_reason is not None:
                finished.append(seq)
        sched.finish(finished)
        return finished


def row_key(seq: Seq) -> tuple:
    """What a sequence's token choice depends on besides its logits and uniform: sequences with equal keys are
    sampled in one call."""
    sp = seq.sampling
    return *decode_graphs.sampling_key(sp, seq.stop_ids), sp.min_new_tokens, sp.top_logprobs


def shares_sampling(seqs: list[Seq], sp: SamplingParams) -> bool:
    """Every one of `seqs` samples as `sp` does, without top log-probs: what a decode graph, which samples one way
    per step, can run."""
    if sp.top_logprobs:
        return False
    key = None
    for s in seqs:
        if s.sampling is not sp:
            key = key or (*decode_graphs.sampling_key(sp, s.stop_ids), sp.min_new_tokens, 0)
            if row_key(s) != key:
                return False
    return True


def call_seed(generator: torch.Generator, sampling: SamplingParams) -> int:
    """A `generate` call's seed: one draw from the engine's generator (reseeded first by `sampling.seed`); each
    sample's stream derives from it (`sample_seed`)."""
    if sampling.seed is not None:
        generator.manual_seed(sampling.seed)
    return int(torch.randint(2**62, (1,), generator=generator, device=generator.device))


def request_caps(n: int, sampling: SamplingParams, max_new_tokens: Sequence[int] | None) -> list[int | None]:
    """Each of `n` requests' own cap on new tokens (None: `sampling.max_new_tokens`), checked."""
    caps = [None] * n if max_new_tokens is None else list(max_new_tokens)
    if len(caps) != n or any(c is not None and not 1 <= c <= sampling.max_new_tokens for c in caps):
        raise ValueError(f"max_new_tokens: one cap in 1..{sampling.max_new_tokens} per request, got {caps}")
    return caps


@functools.lru_cache(maxsize=16)
def _id_tensor(ids: frozenset[int], device: torch.device) -> torch.Tensor:
    """`ids` sorted, as a tensor on `device`: made once per set of stop ids, not in every decode step."""
    return torch.tensor(sorted(ids), device=device)


def engine_options(rollout) -> dict:
    """RolloutEngine keyword arguments from a config's `rollout` section."""
    return {"max_num_seqs": rollout.max_num_seqs, "max_num_batched_tokens": rollout.max_num_batched_tokens,
            "kv_cache_bytes": int(rollout.kv_cache_gb * 2**30),
            "gpu_memory_utilization": rollout.gpu_memory_utilization, "record_routing": rollout.record_routing,
            "graphs": rollout.graphs, "graph_max_batch": rollout.graph_max_batch, "kernels": rollout.kernels,
            "batch_invariant": rollout.batch_invariant, "run_ahead": rollout.run_ahead}
