"""Decode steps from static buffers at bucketed batch sizes, captured as CUDA graphs (HIP graphs on ROCm).

Decode-only engine steps (every scheduled sequence runs exactly one token, no prefill chunk in the step) are most
of a rollout's steps, and at small batches they are bound by kernel launches, not by the GPU's arithmetic.
`DecodeGraphs` runs them from static device buffers: one int64 row per sequence (token id, position, pool slot,
context length, then its block table padded to a fixed width: the most blocks one sequence of this `generate`
call can hold), the batch padded up to a bucket size (1, 2, 4, 8, 16..64 by 8, then by 32 up to
`rollout.graph_max_batch`). The forward reads only these buffers and returns the logits [bucket, V], with no
host reads and no data-dependent shapes (`PagedKV.static`: attention's decode group spans the whole fixed-width
table, masked by the context lengths on the device; the "flex" backend builds its BlockMask from the same table on
the device). Padding rows decode token 0 at position 0, write their k/v into one extra pool block that no sequence
is ever given, and attend to that block only; their logits are dropped.

Modes (the engine's `graph_backend`, from `platform.decode_graph_backend`, then `decode_mode` below):
- "cuda_graph": a bucket is captured the first time a decode step of its size runs in a `generate` call (on the
  engine's side stream, into one memory pool shared by the engine's graphs), and replayed after one host-to-device
  copy of the step's rows. The graphs point at the KV pool: the engine keeps both for later calls that fit (see
  `serves`), so a bucket is captured once in its lifetime; an engine that releases its pool after each call (a
  trainer shares the GPU) drops the graphs with it and captures again in the next call. That recapture is kept
  cheap: warm-up forwards (lazy initialisation: compiled kernels, cuBLAS workspaces) run only for the
  shapes the engine has not decoded before (`Warmth`), and the capture skips `torch.cuda.graph`'s device sync,
  allocator `empty_cache` and host cache flush, so the pool's memory stays cached for the next bucket.
  They read the weights in place: `load_weights` copies into the same tensors, so a weight sync is always seen.
- "static": the same buffers, buckets and padded rows, run eagerly (no capture). The CPU tests force it to check
  the graph path's inputs and padding against the eager engine without a GPU.
- "eager": every step goes through the engine's ordinary forward (`rollout.graphs=false`, CPU, MoE routing being
  recorded); so do steps that do not fit: a prefill chunk in the step, or more sequences than the largest bucket.
Copy-on-write block copies a step needs are made by the engine before the forward, outside any graph.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from twinplane.model import AttentionMetadata, Transformer
from twinplane.model.moe import Experts
from twinplane.platform import platform
from twinplane.rollout.kv_cache import KVCache
from twinplane.rollout.packed import PackedWeight, linear
from twinplane.rollout.paged_attention import PagedKV
from twinplane.rollout.scheduler import ScheduledBatch
from twinplane.rollout.sequence import Sequence

MODES = ("cuda_graph", "static", "eager")
WARMUP_RUNS = 2  # forwards before a capture: lazy initialisation (cuBLAS handles, kernel choice, caches) happens here


def buckets(max_batch: int) -> list[int]:
    """Batch sizes with a static decode, up to and including `max_batch`: 1, 2, 4, 8, 16..64 by 8, then by 32."""
    if max_batch < 1:
        raise ValueError(f"graph_max_batch must be >= 1, got {max_batch}")
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(96, max_batch + 32, 32)]
    return [b for b in sizes if b < max_batch] + [max_batch]


def decode_mode(requested: str, model: Transformer, record_routing: bool) -> str:
    """The mode a `generate` call runs its decode steps in: `requested`, or "eager" where the static forward cannot
    serve: MoE routing being recorded (the record is a host-side side effect of the forward), or a capture of a
    MoE model whose experts run the per-expert loop (it reads the expert counts on the host)."""
    if requested not in MODES:
        raise ValueError(f"decode graph mode must be one of {', '.join(MODES)}, got {requested!r}")
    if requested == "eager" or record_routing:
        return "eager"
    if requested == "cuda_graph" and model.config.num_experts:
        experts = next(m for m in model.modules() if isinstance(m, Experts))
        w = experts.gate_proj
        if not platform.grouped_mm_ok(w.device, w.dtype, tuple(w.shape[1:]), grad=False):
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
    the first call, in blocks);
    `max_batch`: the largest bucket (`rollout.graph_max_batch`); `limit`: the most sequences the call can run at
    once (buckets above the first one that holds them are never needed)."""

    def __init__(self, model: Transformer, kv: KVCache, mode: str, backend: str, max_blocks: int, max_batch: int,
                 limit: int, head: PackedWeight | None = None, warmth: Warmth | None = None):
        if mode not in ("cuda_graph", "static"):
            raise ValueError(f"DecodeGraphs runs the static or cuda_graph mode, not {mode!r}")
        self.model, self.kv, self.mode, self.backend, self.head = model, kv, mode, backend, head
        self.warmth = Warmth() if warmth is None else warmth
        self.window = model.config.sliding_window
        self.block_size, self.max_blocks = kv.block_size, max_blocks
        self.pad_block = kv.num_blocks - 1  # the engine's block manager never hands it out
        self.max_batch, sizes = max_batch, buckets(max_batch)
        self.buckets = sizes[:next((i for i, b in enumerate(sizes) if b >= limit), len(sizes) - 1) + 1]
        dev = kv.k.device
        # columns: token id, position, slot, context length, block table [max_blocks]
        self.inputs = torch.zeros(self.buckets[-1], 4 + max_blocks, dtype=torch.long, device=dev)
        self.cu_seqlens = torch.arange(self.buckets[-1] + 1, dtype=torch.int32, device=dev)  # one query each
        self.pad_row = [0, 0, self.pad_block * self.block_size, 1] + [self.pad_block] * max_blocks
        # The rows are staged on the host (pinned on GPUs: one asynchronous copy per step) and kept between
        # steps: a row's block table is rewritten only when its sequence's table changed (`_held`), since
        # building every row from Python lists costs milliseconds a step at a few hundred sequences.
        self.host = torch.tensor([self.pad_row] * self.buckets[-1], dtype=torch.long)
        if dev.type == "cuda":
            self.host = self.host.pin_memory()
        self._held: list[tuple[list[int], int, int] | None] = [None] * self.buckets[-1]  # None: a padding row
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None  # the graphs' shared memory pool (cuda_graph mode)
        self.steps = 0  # decode steps run here
        self.broken = False  # a capture failed: the engine runs eager from then on

    def serves(self, mode: str, max_blocks: int, limit: int) -> bool:
        """Whether this static decode (over the same pool) can run a later call's steps too: same mode, tables as
        wide as that call needs, and the bucket that holds `limit` sequences."""
        return (not self.broken and mode == self.mode and max_blocks <= self.max_blocks
                and self.buckets[-1] >= min(limit, self.max_batch))

    def fits(self, batch: ScheduledBatch) -> bool:
        """Decode-only, within the largest bucket, every block table within the fixed width."""
        return (not self.broken and batch.num_decodes == len(batch) <= self.buckets[-1]
                and all(len(s.block_table) <= self.max_blocks for s in batch.seqs))

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def step(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """Decode one token of each of `seqs` (their `num_computed` advance): logits [len(seqs), V]; None when a
        capture failed (nothing was run; the caller runs the step eagerly)."""
        n, bs = len(seqs), self.block_size
        size = self.bucket(n)
        if self.mode == "cuda_graph" and size not in self.graphs and not self._capture(size):
            return None
        host, held, toks, pos, slots = self.host.numpy(), self._held, [], [], []
        for i, seq in enumerate(seqs):
            p, table = seq.num_computed, seq.block_table
            toks.append(seq.tokens[p])
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            seq.num_computed = p + 1
            # The block manager appends to a table, replaces its last block (copy-on-write) or gives the
            # sequence a new list (freed): the same list, length and last block mean the same table. (Holding
            # the list keeps its identity from being reused.)
            h = held[i]
            if h is None or h[0] is not table or h[1] != len(table) or h[2] != table[-1]:
                host[i, 4:4 + len(table)] = table
                host[i, 4 + len(table):] = self.pad_block
                held[i] = table, len(table), table[-1]
        host[:n, 0], host[:n, 1], host[:n, 2] = toks, pos, slots
        host[:n, 3] = host[:n, 1] + 1
        for i in range(n, size):
            if held[i] is not None:
                host[i] = self.pad_row
                held[i] = None
        # (asynchronous from pinned memory: the host rows change again only after this step's tokens are read
        # back, which waits for the copy, queued before the forward on the same stream)
        self.inputs[:size].copy_(self.host[:size], non_blocking=True)
        self.steps += 1
        if self.mode == "static":
            return self.forward(size)[:n]
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]  # read before the next replay overwrites it (the engine samples from it at once)

    @torch.no_grad()  # (the Triton kernels' module variants run their kernels only without autograd)
    def forward(self, size: int) -> torch.Tensor:
        """The static decode of the first `size` rows of `inputs` -> logits [size, V]: what a graph captures."""
        x, bs = self.inputs[:size], self.block_size
        paged = PagedKV(self.kv.k, self.kv.v, x[:, 2].contiguous(), x[:, 4:].to(torch.int32),
                        x[:, 3].to(torch.int32), self.cu_seqlens[:size + 1], [1] * size, size,
                        self.max_blocks * bs, static=True)
        meta = AttentionMetadata(x[None, :, 1], window=self.window, backend=self.backend, paged=paged)
        h = self.model.hidden_states(x[None, :, 0], meta=meta)[0]  # [size, D]
        return linear(h, self.model.output_weight(), self.head)

    def _capture(self, size: int) -> bool:
        """Capture the bucket `size` (inputs all padding rows meanwhile: the warm-up forwards run for real and
        must write into the reserved block only). False, with a warning, when the capture fails."""
        dev, shape = self.inputs.device, (size, self.max_blocks)
        self.inputs[:size].copy_(torch.tensor([self.pad_row] * size, dtype=torch.long))
        try:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            if self.warmth.stream is None:
                self.warmth.stream = torch.cuda.Stream(dev)
            side, main = self.warmth.stream, torch.cuda.current_stream(dev)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for _ in range(0 if shape in self.warmth.shapes else WARMUP_RUNS):
                    self.forward(size)
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(self.pool, capture_error_mode="thread_local")
                try:
                    logits = self.forward(size)
                finally:
                    graph.capture_end()
            main.wait_stream(side)
        except (RuntimeError, ValueError) as e:  # CUDA's errors, and ValueError for a tensor off the GPU
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            warnings.warn(f"rollout engine: capturing the decode graph of batch {size} failed ({first}); decoding "
                          "eagerly from now on (rollout.graphs=false turns graphs off)", stacklevel=3)
            self.broken = True
            self.graphs.clear()
            return False
        self.graphs[size] = graph, logits
        self.warmth.shapes.add(shape)
        return True
