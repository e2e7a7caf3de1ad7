"""Decode steps from static buffers at bucketed batch sizes, captured as CUDA graphs (HIP graphs on ROCm).

Decode-only engine steps (every scheduled sequence runs exactly one token, no prefill chunk in the step) are most
of a rollout's steps, and at small batches they are bound by kernel launches, not by the GPU's arithmetic.
`DecodeGraphs` runs them from static device buffers, the batch padded up to a bucket size (1, 2, 4, 8, 16..64 by 8,
then by 32 up to `rollout.graph_max_batch`). One step is one graph: the forward (embedding, layers, final norm, LM
head), the sampler (the token and its policy log-prob, as the engine's `_sample` chooses them from the same
uniforms), and the update of each row to its next token on the device. Per step the host stages, in one
asynchronous copy from pinned memory, each row's uniform and flags, the row the device holds its state in (rows
move up as sequences leave the batch), a new block table where it changed, and a whole state row only for a
sequence that did not simply continue (new in the batch, preempted, anything else); the tokens and log-probs come
back in one asynchronous copy [2, B]. `launch` queues a step and `finish` waits for its tokens, so the engine can
launch the next step before reading this one back (`RolloutEngine.engine_step`): the device then holds each
sequence's last token before the host does. A row's state is one int64 row: token id, position, pool slot
(worked out on the device from the table), context length, then its block table padded to a fixed width (the most
blocks one sequence of the first `generate` call can hold). The
forward reads only these buffers, with no host reads and no data-dependent shapes (`PagedKV.static`: attention's
decode group spans the whole fixed-width table, masked by the context lengths on the device; the "flex" backend
builds its BlockMask from the same table on the device). Padding rows decode token 0 at position 0, write their
k/v into one extra pool block that no sequence is ever given, and attend to that block only; their outputs are
dropped.

Modes (the engine's `graph_backend`, from `backends.decode_graph_backend`, then `decode_mode` below):
- "cuda_graph": a (bucket, sampler) step is captured the first time a decode step of its size runs with those
  sampling parameters (`sampling_key`; an RL run keeps one), on the engine's side stream, into one memory pool
  shared by the engine's graphs, and replayed after the staging copy. The graphs point at the KV pool: the
  engine keeps both for later calls that fit (see `serves`), so a bucket is captured once in its lifetime; an
  engine that releases its pool after each call (a trainer shares the GPU) drops the graphs with it and captures
  again in the next call. That recapture is kept cheap: warm-up runs (lazy initialisation: compiled kernels,
  cuBLAS workspaces) run only for the shapes the engine has not decoded before (`Warmth`), and the capture skips
  `torch.cuda.graph`'s device sync, allocator `empty_cache` and host cache flush, so the pool's memory stays
  cached for the next bucket. They read the weights in place: `load_weights` copies into the same tensors, so a
  weight sync is always seen.
- "static": the same buffers, buckets, padded rows and device-side update, run eagerly (no capture). The CPU tests
  force it to check the graph path against the eager engine without a GPU.
- "eager": every step goes through the engine's ordinary forward (`rollout.graphs=false`, CPU, MoE routing being
  recorded); so do steps that do not fit: a prefill chunk in the step, or more sequences than the largest bucket.
Copy-on-write block copies a step needs are made by the engine before the forward, outside any graph.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from twinplane.errors import first_line
from twinplane.model import AttentionMetadata, Transformer
from twinplane.model.moe import Experts
from twinplane.model.transformer import cap_logits
from twinplane.platform import backends
from twinplane.rollout.kv_cache import KVCache
from twinplane.rollout.paged_attention import PagedKV
from twinplane.rollout.prepacked import PrepackedWeight, lm_head
from twinplane.rollout.sampling import SamplingParams, policy_logprobs, sample
from twinplane.rollout.scheduler import ScheduledBatch
from twinplane.rollout.sequence import Sequence

MODES = ("cuda_graph", "static", "eager")
WARMUP_RUNS = 2  # runs before a capture: lazy initialisation (cuBLAS handles, kernel choice, caches) happens here
# Columns staged per row: flags, the uniform's bits, the row the device holds its state in, then a state row.
RESET, LIVE, BAN, UNIFORM, SRC, RETABLE, STATE = range(7)
TOK, POS, SLOT, CTX, TABLE = range(5)  # columns of a row's state: TABLE is where its block table starts


def buckets(max_batch: int) -> list[int]:
    """Batch sizes with a static decode, up to and including `max_batch`: 1, 2, 4, 8, 16..64 by 8, then by 32."""
    if max_batch < 1:
        raise ValueError(f"graph_max_batch must be >= 1, got {max_batch}")
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(96, max_batch + 32, 32)]
    return [b for b in sizes if b < max_batch] + [max_batch]


def decode_mode(requested: str, model: Transformer, record_routing: bool) -> str:
    """The mode a `generate` call runs its decode steps in: `requested`, or "eager" where the static forward cannot
    serve: MoE routing being recorded (the record is a host-side side effect of the forward), or a capture of a
    MoE model whose experts run the per-expert loop (it reads the expert counts on the host), or a model with
    linear-attention layers (their per-sequence states live in a pool the static buffers do not address)."""
    if requested not in MODES:
        raise ValueError(f"decode graph mode must be one of {', '.join(MODES)}, got {requested!r}")
    if requested == "eager" or record_routing or model.config.linear_layers:
        return "eager"
    if requested == "cuda_graph" and model.config.num_experts:
        experts = next(m for m in model.modules() if isinstance(m, Experts))
        w = experts.gate_proj
        if not backends.grouped_mm_ok(w.device, w.dtype, tuple(w.shape[1:]), grad=False):
            return "eager"
    return requested


@dataclass
class Warmth:
    """What an engine's earlier `generate` calls leave to its later captures: the side stream they capture on (one
    stream, so its cuBLAS workspace is made once) and the (bucket, table width) shapes already decoded on it."""

    stream: torch.cuda.Stream | None = None
    shapes: set[tuple[int, int]] = field(default_factory=set)


class DecodeGraphs:
    """Static (and on GPUs captured) decode steps over `kv`, whose last block is reserved for padding rows, for a
    `generate` call and the later ones it `serves`. `max_blocks`: the block-table width (the longest sequence of
    the first call, in blocks); `max_batch`: the largest bucket (`rollout.graph_max_batch`); `limit`: the most
    sequences the call can run at once (buckets above the first one that holds them are never needed); `fused`:
    sample with the Triton sampler where it serves (no top-k/top-p)."""

    def __init__(self, model: Transformer, kv: KVCache, mode: str, backend: str, max_blocks: int, max_batch: int,
                 limit: int, head: PrepackedWeight | None = None, warmth: Warmth | None = None, fused: bool = False):
        if mode not in ("cuda_graph", "static"):
            raise ValueError(f"DecodeGraphs runs the static or cuda_graph mode, not {mode!r}")
        self.model, self.kv, self.mode, self.backend, self.head, self.fused = model, kv, mode, backend, head, fused
        self.warmth = Warmth() if warmth is None else warmth
        self.window = model.config.sliding_window
        self.block_size, self.max_blocks = kv.block_size, max_blocks
        self.pad_block = kv.num_blocks - 1  # the engine's block manager never hands it out
        self.max_batch, sizes = max_batch, buckets(max_batch)
        self.buckets = sizes[:next((i for i, b in enumerate(sizes) if b >= limit), len(sizes) - 1) + 1]
        dev, rows = kv.k.device, self.buckets[-1]
        self.pad_row = [0, 0, self.pad_block * self.block_size, 1] + [self.pad_block] * max_blocks
        # The rows' state on the device (token id, position, slot, context length, block table [max_blocks]),
        # advanced by the step itself. What the host stages for a step (one asynchronous copy from pinned memory)
        # says per row where the device holds its state (SRC: rows move when others leave the batch) and replaces
        # the state only where its sequence did not just continue (RESET), or its table alone (RETABLE).
        width = STATE + 4 + max_blocks
        self.inputs = torch.tensor([self.pad_row] * rows, dtype=torch.long, device=dev)
        # A padding row as staged: reset to the padding state (table too), not live, its uniform 0 (SRC: its own row)
        self.pad_staged = np.zeros((1, width), dtype=np.int64)
        self.pad_staged[0, [RESET, RETABLE]] = 1
        self.pad_staged[0, STATE:] = self.pad_row
        self.staged = torch.zeros(rows, width, dtype=torch.long, device=dev)
        self._stage_padding(rows)
        # Two of each host buffer, used in turn: a step is staged, and its tokens land, while the step before it
        # may still be running (`launch` ... `finish`).
        pinned = dev.type == "cuda"
        self.host = [_host((rows, width), torch.long, pinned) for _ in range(2)]
        # (flat: a step's [2, size] lands in the first 2 x size, contiguous. A strided destination would make torch
        # stage the copy through pageable memory, which returns only once the device has run the step.)
        self.readback = [_host((2 * rows,), torch.float64, pinned) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)] if pinned else None
        self.cu_seqlens = torch.arange(rows + 1, dtype=torch.int32, device=dev)  # one query each
        # Where each sequence of the last launched step is on the device: id -> [sequence (kept alive, so its id
        # is not reused), its next position, block table (the list, its length, its last block), the token
        # sampled (None until read back), row].
        self._rows: dict[int, list] = {}
        self._banned: dict[tuple[int, ...], torch.Tensor] = {}  # stop ids -> tensor (made outside any capture)
        self._sampler: tuple = (None, None, None)  # the last (sampling fields, stop ids, `sampling_key`)
        self.graphs: dict[tuple[int, tuple], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None  # the graphs' shared memory pool (cuda_graph mode)
        self.launches = 0  # steps launched (which host buffers a step uses)
        self.steps = 0  # decode steps run here
        self.wait = 0.0  # seconds the host spent blocked reading steps back (the device still running them)
        self.broken = False  # a capture failed: the engine runs eager from then on

    def serves(self, mode: str, max_blocks: int, limit: int) -> bool:
        """Whether this static decode (over the same pool) can run a later call's steps too: same mode, tables as
        wide as that call needs, and the bucket that holds `limit` sequences."""
        return (not self.broken and mode == self.mode and max_blocks <= self.max_blocks
                and self.buckets[-1] >= min(limit, self.max_batch))

    def fits(self, batch: ScheduledBatch) -> bool:
        """Decode-only, one sample per sequence (no fork), within the largest bucket, every block table within the
        fixed width."""
        return (not self.broken and batch.num_decodes == len(batch) <= self.buckets[-1]
                and all(s.width == 1 and len(s.block_table) <= self.max_blocks for s in batch.seqs))

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def launch(self, seqs: list[Sequence], sp: SamplingParams, ahead: bool = False) -> Launched | None:
        """Start decoding one token of each of `seqs` (their `num_computed` advance; each draws one uniform): the
        staging copy and the step are queued, nothing waits for them. `ahead`: the sequences' last tokens are
        still on the device only (the step before is not read back yet: the device has each of them in its row),
        so a step that needs a capture does not launch (a capture resets rows). None when nothing was launched
        (a capture failed, or was needed ahead)."""
        n = len(seqs)
        size, key = self.bucket(n), self._sampling_key(sp, seqs[0].stop_ids)
        if self.mode == "cuda_graph" and (size, key) not in self.graphs and (ahead or not self._capture(size, key)):
            return None
        buf = self.launches % 2
        host, rows, placed = self.host[buf].numpy(), self._rows, {}
        reset, src, retable, uniforms = [0] * n, list(range(n)), [0] * n, [0.0] * n
        for i, seq in enumerate(seqs):
            p, table, sid = seq.num_computed, seq.block_table, id(seq)
            e = rows.get(sid)
            # The device holds this row if the last step advanced it here (and the host did not change its token
            # since). The block manager appends to a table, replaces its last block (copy-on-write) or gives the
            # sequence a new list (freed): the same list, length and last block mean the same table.
            if e is not None and e[0] is seq and e[1] == p and (e[5] is None or seq.tokens[p] == e[5]):
                src[i] = e[6]
                retable[i] = not (e[2] is table and e[3] == len(table) and e[4] == table[-1])
            else:
                reset[i] = retable[i] = 1
                host[i, STATE:STATE + TABLE] = seq.tokens[p], p, 0, p + 1  # (the slot: worked out on the device)
            if retable[i]:
                host[i, STATE + TABLE:STATE + TABLE + len(table)] = table
                host[i, STATE + TABLE + len(table):] = self.pad_block
            uniforms[i] = seq.rngs[0].random()  # (a double: rounded to float32 on the device, as `_sample` does)
            placed[sid] = [seq, p + 1, table, len(table), table[-1], None, i]
            seq.num_computed = p + 1
        host[:n, RESET], host[:n, SRC], host[:n, RETABLE], host[:n, LIVE] = reset, src, retable, 1
        host.view(np.float64)[:n, UNIFORM] = uniforms
        # stop tokens banned while short of min_new_tokens (generated so far: the tokens after the prompt up to
        # and including the one this step reads, whether or not the host has it yet)
        host[:n, BAN] = [s.num_computed - s.prompt_len < sp.min_new_tokens for s in seqs] if key[3] else 0
        host[n:size] = self.pad_staged
        host[n:size, SRC] = np.arange(n, size)
        self._rows = placed
        # (asynchronous from pinned memory: this buffer is written again two launches on, after this step's
        # tokens were read back, which waits for the copy, queued before the step on the same stream)
        self.staged[:size].copy_(self.host[buf][:size], non_blocking=True)
        if self.mode == "static":
            out = self.run(size, key)
        else:
            graph, out = self.graphs[size, key]
            graph.replay()
        back = self.readback[buf][:2 * size].view(2, size)
        back.copy_(out, non_blocking=True)
        if self.events is not None:
            self.events[buf].record()
        self.launches += 1
        self.steps += 1
        return Launched(buf, list(placed.values()), self.launches, back)  # (in row order)

    def finish(self, step: Launched) -> tuple[list[int], list[float]]:
        """Wait for a launched step: its tokens and their policy log-probs (one read back for both: float64 holds
        every token id and each fp32 log-prob exactly)."""
        if self.events is not None:
            t0 = time.perf_counter()
            self.events[step.buffer].synchronize()
            self.wait += time.perf_counter() - t0
        out = step.back[:, :len(step.rows)]
        tokens, logprobs = out[0].long().tolist(), out[1].tolist()
        if step.launch == self.launches:  # no step launched since: the next one checks its rows' tokens
            for e, t in zip(step.rows, tokens, strict=True):
                e[5] = t
        return tokens, logprobs

    def _sampling_key(self, sp: SamplingParams, stop_ids: frozenset[int]) -> tuple:
        """`sampling_key`, worked out again only when the sampling fields or the stop-id set change (not in every
        step: the stop ids can be hundreds), its stop-id tensor made then, outside any capture."""
        fields = sp.temperature, sp.top_k, sp.top_p, sp.min_new_tokens
        if fields != self._sampler[0] or stop_ids is not self._sampler[1]:
            key = sampling_key(sp, stop_ids)
            if key[3] and key[3] not in self._banned:
                self._banned[key[3]] = torch.tensor(key[3], device=self.inputs.device)
            self._sampler = fields, stop_ids, key
        return self._sampler[2]

    @torch.no_grad()  # (the Triton kernels' module variants run their kernels only without autograd)
    def run(self, size: int, key: tuple) -> torch.Tensor:
        """One step of the first `size` rows, what a graph captures: the staged rows in, the forward, the sampler
        (`key`: `sampling_key`), the rows advanced to their next token on the device -> [2, size] float64: the
        tokens and their policy log-probs (float64 holds both exactly)."""
        st, x, bs = self.staged[:size], self.inputs[:size], self.block_size
        moved = self.inputs.index_select(0, st[:, SRC])  # [size, W] each row's state from where the device holds it
        x[:, :TABLE] = torch.where(st[:, RESET, None] != 0, st[:, STATE:STATE + TABLE], moved[:, :TABLE])
        x[:, TABLE:] = torch.where(st[:, RETABLE, None] != 0, st[:, STATE + TABLE:], moved[:, TABLE:])
        pos = x[:, POS]
        x[:, SLOT] = x[:, TABLE:].gather(1, (pos // bs).clamp(max=self.max_blocks - 1)[:, None])[:, 0] * bs + pos % bs
        logits = self.forward(size)
        temperature, top_k, top_p, stop_ids = key
        u = st[:, UNIFORM].view(torch.float64).float()  # [size] (the same bits: int64 and float64 are 8 bytes)
        banned = self._banned[stop_ids] if stop_ids else None
        rows = st[:, BAN] != 0 if stop_ids else None
        if self.fused and top_k == 0 and top_p == 1.0:
            from twinplane.rollout.kernels.sampler import sample_tokens  # (imports Triton)

            tok, logp = sample_tokens(logits, temperature, u, banned, rows)
        else:
            lp = policy_logprobs(logits, temperature)  # [size, V]
            tok = sample(lp, SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k), u, banned, rows)
            logp = lp.gather(-1, tok[:, None])[:, 0]
        # the next step's rows: each live row's sampled token at the next position (its slot is worked out from
        # its table as the next step starts: a row whose next position needs a new block gets it from the host)
        live = st[:, LIVE]
        x[:, TOK] = torch.where(live != 0, tok, x[:, TOK])
        x[:, POS] += live
        x[:, CTX] += live
        return torch.stack([tok.double(), logp.double()])

    @torch.no_grad()
    def forward(self, size: int) -> torch.Tensor:
        """The model's decode forward of the first `size` rows of `inputs` -> logits [size, V]."""
        x, bs = self.inputs[:size], self.block_size
        paged = PagedKV(self.kv.k, self.kv.v, x[:, SLOT].contiguous(), x[:, TABLE:].to(torch.int32),
                        x[:, CTX].to(torch.int32), self.cu_seqlens[:size + 1], [1] * size, size,
                        self.max_blocks * bs, static=True, kv_index=self.kv.index)
        # longrope: a decoding sequence takes the long factors exactly when its context is past the limit (the
        # scheduler re-encodes it there)
        limit = self.model.longrope_limit
        meta = AttentionMetadata(x[None, :, POS], window=self.window, backend=self.backend, paged=paged,
                                 rope_long=None if limit is None else x[None, :, CTX] > limit)
        h = self.model.hidden_states(x[None, :, TOK], meta=meta)[0]  # [size, D]
        return cap_logits(lm_head(h, self.model.output_weight(), self.head),
                          self.model.config.final_logit_softcapping)

    def _stage_padding(self, size: int) -> None:
        """The first `size` staged rows: padding rows (what the device runs them on until the host stages more)."""
        dev = self.staged.device
        self.staged[:size] = torch.from_numpy(self.pad_staged).to(dev)
        self.staged[:size, SRC] = torch.arange(size, device=dev)

    def _capture(self, size: int, key: tuple) -> bool:
        """Capture the step of bucket `size` with the sampler `key` (rows all padding meanwhile: the warm-up runs
        are real and must write into the reserved block only). False, with a warning, when the capture fails."""
        dev, shape = self.inputs.device, (size, self.max_blocks, key)
        self._stage_padding(size)
        self._rows = {}  # (the device rows are padding rows after these runs: every row is staged afresh)
        try:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            if self.warmth.stream is None:
                self.warmth.stream = torch.cuda.Stream(dev)
            side, main = self.warmth.stream, torch.cuda.current_stream(dev)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for _ in range(0 if shape in self.warmth.shapes else WARMUP_RUNS):
                    self.run(size, key)
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(self.pool, capture_error_mode="thread_local")
                try:
                    out = self.run(size, key)
                finally:
                    graph.capture_end()
            main.wait_stream(side)
        except (RuntimeError, ValueError) as e:  # CUDA's errors, and ValueError for a tensor off the GPU
            warnings.warn(f"rollout engine: capturing the decode graph of batch {size} failed ({first_line(e)}); "
                          "decoding eagerly from now on (rollout.graphs=false turns graphs off)", stacklevel=3)
            self.broken = True
            self.graphs.clear()
            return False
        self.graphs[size, key] = graph, out
        self.warmth.shapes.add(shape)
        return True


@dataclass
class Launched:
    """A launched step: its host buffers, per row the sequence's entry (`DecodeGraphs._rows`), which launch it was
    (`DecodeGraphs.launches` after it), and where its tokens and log-probs land ([2, bucket], host memory)."""

    buffer: int
    rows: list[list]
    launch: int
    back: torch.Tensor

    def current(self, seqs: list[Sequence]) -> list[int]:
        """The rows whose tokens still belong to their sequences (`seqs`, in row order): those that have not
        stopped, nor changed their tokens, since."""
        rows = self.rows
        return [i for i, s in enumerate(seqs) if s.finish_reason is None and len(s.tokens) == rows[i][1]]


def _host(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    t = torch.zeros(shape, dtype=dtype)
    return t.pin_memory() if pinned else t


def sampling_key(sp: SamplingParams, stop_ids: frozenset[int]) -> tuple:
    """What a captured step's sampler is specialised to: (temperature, top_k, top_p, the stop ids banned in rows
    short of `min_new_tokens`, sorted; () when none are)."""
    banned = tuple(sorted(stop_ids)) if sp.min_new_tokens and stop_ids else ()
    return float(sp.temperature), sp.top_k, float(sp.top_p), banned
