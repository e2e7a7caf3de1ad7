"""Continuous batching: which sequences run in the next forward, and how many of their tokens.

Each step, oldest first: every running sequence gets its next token (a decode) or its next prefill chunk, then
waiting sequences are admitted into what is left of the token budget (`max_num_batched_tokens`), the running-set
cap (`max_num_seqs`, a sequence with n samples counting n) and the block pool. A prompt longer than the budget is
prefilled in chunks over several steps, mixed with the other sequences' decodes.
When the pool cannot hold the next token of a running sequence, the most recently admitted sequences are
preempted: their blocks are freed and they go back to the front of the queue, to be recomputed (prompt and
generated tokens prefilled again) when there is room. The oldest sequence can always proceed, since one
sequence at its longest fits the pool (the engine checks), so the scheduler never deadlocks.

A longrope model (Phi-3) rotates by its short factors while a sequence is within the pretraining length, and by
its long ones, at every position, once it is longer (`ModelConfig.longrope_limit`): transformers' `generate` re-encodes
the whole sequence where it crosses. So does the scheduler: a sequence starts with the set its length calls for
(`Sequence.long_rope`), and one that grows past the limit is recomputed with the long set, keeping its samples.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from twinplane.rollout.block_manager import BlockManager
from twinplane.rollout.sequence import Sequence


@dataclass
class ScheduledBatch:
    """The next forward: sequences and how many of their pending tokens run, decodes first (the paged layout's
    order). Tokens are laid out in this order, so token t of the forward maps back to (sequence, position)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    num_decodes: int = 0
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write block copies to make first

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 longrope_limit: int | None = None):
        self.blocks = blocks
        self.longrope_limit = longrope_limit  # longrope's pretraining length (None: another rope)
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: preemption takes from the end
        self.num_running = 0  # running-set slots taken: the running sequences' widths (kept, not summed per step)
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        if self.longrope_limit is not None:
            self._switch_rope()
        decodes, prefills = ScheduledBatch(), ScheduledBatch()
        pending = [s.num_pending for s in self.running]
        budget = self.max_num_batched_tokens - pending.count(1)  # decodes go first
        i, preempted, has_slot = 0, False, self.blocks.has_slot
        while i < len(self.running):
            seq = self.running[i]
            decode = pending[i] == 1
            if decode and has_slot(seq):  # the common decode: nothing to allocate
                decodes.seqs.append(seq)
                i += 1
                continue
            # (decodes always run, so when they alone exceed the token budget a prefill chunk waits)
            want = 1 if decode else min(seq.num_pending, max(budget, 0))
            if want == 0:
                i += 1
                continue
            while self.blocks.room(seq) < want:
                if not decode and self.blocks.room(seq) > 0:  # a prefill chunk takes what fits
                    want = self.blocks.room(seq)
                    break
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if preempted and victim is seq:
                break  # `seq` itself was the newest: it waits, and nothing after it is running
            if decode:
                decodes.copies += self.blocks.allocate(seq, 1)
                decodes.seqs.append(seq)
            else:
                prefills.copies += self.blocks.allocate(seq, want)
                prefills.seqs.append(seq)
                prefills.num_tokens.append(want)
                budget -= want
            i += 1
        # Admit while the whole remaining prompt fits the free blocks (not only this step's chunk: a prompt that
        # cannot finish prefilling would only be preempted again); none in a step that had to preempt.
        while self.waiting and budget > 0 and not preempted:
            seq = self.waiting[0]
            if self.running and self.num_running + seq.width > self.max_num_seqs:
                break
            if self.blocks.room(seq) < seq.num_pending:
                break
            want = min(seq.num_pending, budget)
            self.waiting.popleft()
            seq.long_rope = self.longrope_limit is not None and len(seq.tokens) > self.longrope_limit
            self.running.append(seq)
            self.num_running += seq.width
            prefills.copies += self.blocks.allocate(seq, want)
            prefills.seqs.append(seq)
            prefills.num_tokens.append(want)
            budget -= want
        d = len(decodes.seqs)
        return ScheduledBatch(decodes.seqs + prefills.seqs, [1] * d + prefills.num_tokens, d,
                              decodes.copies + prefills.copies)

    def schedule_ahead(self, max_blocks: int) -> ScheduledBatch | None:
        """The next decode of every running sequence that may go on, scheduled before the step that samples their
        last tokens is read back (the engine's run-ahead): a sequence whose token in flight is its last by length
        sits it out; one that turns out to have stopped is dropped when the step is read. None, changing nothing,
        where the ordinary schedule could differ: a sequence waiting (admissions wait for the finished ones), a
        sequence not decoding, or blocks short (a preemption) or past `max_blocks` per table."""
        if self.waiting:
            return None
        seqs, grow, has_slot = [], [], self.blocks.has_slot
        limit = self.longrope_limit
        for s in self.running:  # (every running sequence, every step: attributes, not properties)
            if s.num_computed + 1 - s.prompt_len >= s.max_new_tokens:
                continue
            if len(s.rngs) != 1 or len(s.tokens) != s.num_computed:  # forked later, or not decoding
                return None
            if limit is not None and s.num_computed + 1 > limit and not s.long_rope:  # re-encoded: `_switch_rope`
                return None
            seqs.append(s)
            if not has_slot(s):  # it takes one block: a new one, or its copy-on-write copy
                grow.append(s)
        bs = self.blocks.block_size
        if not seqs or len(grow) > self.blocks.num_free or \
                any(len(s.block_table) + (s.num_computed % bs == 0) > max_blocks for s in grow):
            return None
        copies = [c for s in grow for c in self.blocks.allocate(s, 1)]
        return ScheduledBatch(seqs, [1] * len(seqs), len(seqs), copies)

    def _switch_rope(self) -> None:
        """Running sequences grown past the longrope limit with k/v of the short factors: their blocks are freed
        and they go on running from their first token, with the long factors (not a preemption: nothing waits)."""
        for seq in self.running:
            if not seq.long_rope and len(seq.tokens) > self.longrope_limit:
                self.blocks.release(seq)
                seq.long_rope = True

    def _preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and queue it first for recomputation (its samples and random state are kept)."""
        self.running.remove(seq)
        self.num_running -= seq.width
        self.blocks.release(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def requeue_running(self) -> None:
        """Every running sequence back to the front of the queue, in order, without its blocks: each is recomputed
        (prompt and generated tokens prefilled again) when it runs next (new weights: k/v of the new ones)."""
        for seq in reversed(self.running):
            self.blocks.release(seq)
            self.waiting.appendleft(seq)
        self.running, self.num_running = [], 0

    def finish(self, seqs: list[Sequence]) -> None:
        """Retire finished sequences (one pass over the running set, however many finish at once)."""
        if not seqs:
            return
        done = {id(s) for s in seqs}
        self.running = [s for s in self.running if id(s) not in done]
        for s in seqs:
            self.num_running -= s.width
            self.blocks.release(s)
