"""Several requests in one model pass: each request's lane of a context (the target's, the
draft's), and the gates where their passes meet.

A `Lane` is one request's share of a context: a range of its sequence ids (the
committed text in the first, tree colours or chains in the rest), the context length a request
may use, and how its passes run. A lane of its own (the default) decodes at once; lanes that
share a `PassGate` hand their batches to it and wait: when every lane that is decoding has
handed one in, the last to arrive runs them as one batch, and each gets its own rows of the
logits back. Each lane decodes in a thread of its own (the server's requests), so a request's
drafting, sampling and streaming run while the others do theirs; the passes are shared.

The rules of the gate:
- A pass runs only when every member is waiting at the gate, so no member is still reading the
  logits of the pass before (the rows it got are views into llama.cpp's buffer, valid until the
  next pass: nothing is copied).
- Decoding steps (a pending token and its tree) go together, as many as fit one batch. A solo
  batch runs in a pass of its own, every other pass while steps wait, the smallest first: a
  prompt's chunk (a whole batch on the prefill grid, decoding.kv), evaluated exactly as alone, so
  a short request's first token waits for one chunk at most; and a seeded request's steps, whose
  draws must not depend on what else runs (llama.cpp's kernels round a token's row differently
  in batches of other sizes).
  With --throughput (`Lane.prompts_join`) a prompt's chunks, half a batch each, go with the
  steps instead, as llama-server batches them: no pass of its own, its KV and last row rounded
  as that pass rounds them (a greedy answer may part from the same request alone at a near-tie).
- A member that is not waiting (drafting, editing its sequences) holds the pass back; one that
  leaves lets it go. A request joins (`Lane.join`) before it touches its lane's cache, waiting
  for a pass that runs to end: llama.cpp's cache must not be edited while a pass reads it, and a
  request between two of its passes edits it (trims a prompt, keeps a tree's accepted branch).
- The draft model's context is shared the same way (one draft context, a lane of it for each
  request, its own gate): one draft pass expands every drafting request's tree; so is a target's
  MTP context (a batch of its carries a hidden row per token: `Context.new_batch`), one pass
  for the next draft of every drafting request's chain. The gates of one
  set of requests meet in a `Room`: a pass of either context runs only when every request waits
  at one gate or the other, the draft's first (a request still drafting is on its way to the
  target's gate, and its tree should join that pass). One pass runs at a time, whichever the
  context: they share the machine's cores.
- A target with a recurrent state, or a cache per request (--kv-split), splits a batch into
  ubatches that hold as many tokens of every sequence (from sequences in ascending order; a
  recurrent state rolls back only within the ubatch that made it): there, steps go together only
  where every sequence of every step holds as many tokens (chains of one length), in the order of
  their sequences, so the pass stays one ubatch.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from specrun.core.tree_shapes import NETWORK_PASSES
from specrun.decoding.pay.counts import MetCounts, met_counts
from specrun.engine import Batch, Context
from specrun.limits import MAX_SEQ

# The fewest tokens of a pass from which llama.cpp's CPU flash attention takes its query rows in
# tiles (GGML_FA_TILE_Q), each row's scores summed in groups of 64 cells counted from the cache's
# first: a pass of this many or more rounds a row as any other such pass does, with the row's cells
# in the same place (docs/exactness.md, "Prefill against prefill"; kv.resumes_alike measures it).
TILE_ROWS = 64


def fill_count(ctx: Context, n_tokens: int, most: int) -> int:
    """Filler tokens a pass over n_tokens takes where `ctx`'s work runs on RPC workers (pay.counts),
    up to `most` tokens in all: to a count met before where that pays, else to a tree pass's count
    (core.tree_shapes.NETWORK_PASSES), which it then meets; a pass under TILE_ROWS stays under it."""
    if n_tokens < TILE_ROWS:
        most = min(most, TILE_ROWS - 1)
    return met_counts(ctx.model).fill_to(n_tokens, most, ctx.network_s, NETWORK_PASSES) - n_tokens


def _decode(ctx: Context, batch: Batch, meanwhile: Callable[[threading.Event], None] | None = None) -> float:
    """Run the pass over `batch`; return its seconds. `meanwhile(done)`: called while the pass
    runs (beside it, engine.compute.start_beside: a context whose work runs elsewhere)."""
    if meanwhile is None:
        t0 = time.perf_counter()
        ctx.decode(batch)
        return time.perf_counter() - t0
    job = ctx.start_decode(batch)
    try:
        meanwhile(job.done)
    finally:
        seconds = ctx.finish_decode(job, batch)
    return seconds


class Lane:
    """One request's share of a target context: its sequence ids, its context length, and how its
    passes run (at once, or through a gate with other lanes')."""

    def __init__(self, ctx: Context, seqs: range | None = None, n_ctx: int | None = None,
                 gate: PassGate | None = None, prompts_join: bool = False):
        self.ctx = ctx
        # The request the lane serves (its target lane; a drafter's `attach` sets a draft lane's):
        # its target lane and its draft lane wait for one another's passes as one member of the
        # gates' room.
        self.owner: object = self
        self.seqs = seqs if seqs is not None else range(ctx.n_seq_max)
        self.n_ctx = n_ctx or ctx.n_ctx
        self.gate = gate
        # --throughput: a prompt's chunks go through the gate as steps do, in passes that hold
        # other requests' steps (not computed as alone: decoding.kv), instead of passes of their own.
        self.prompts_join = prompts_join and gate is not None
        # The whole context: whole-cache calls (clear, seq_keep) are cheaper and do the same.
        self.whole = gate is None and len(self.seqs) == ctx.n_seq_max
        self.shared = 1  # requests whose tokens the last pass held (1: this lane's alone)
        self.pass_s = 0.0  # seconds llama.cpp took over the last pass (not the wait for it)
        self.pass_tokens = 0  # tokens the last pass held, every request's (a point of the context's cost curve)
        # Whether the last pass, shared through the gate, met a count of tokens new to the process
        # over RPC workers: its seconds hold round trips that no later pass of that count pays.
        self.new_count = False
        # The lane's last batch: its first position, its tokens, and where its first token sat in
        # the pass (the pass's per-token outputs, an MTP drafter's target rows, are in batch order).
        self.last_batch = (0, 0, 0)

    @property
    def sharing(self) -> bool:
        """Whether other lanes decode now (their passes shared with this one's)."""
        return self.gate is not None and self.gate.active > 1

    @property
    def base(self) -> int:
        """The sequence that holds the lane's committed text (tree colour 0)."""
        return self.seqs.start

    def run(self, batch: Batch, solo: bool = False, meanwhile: Callable[[threading.Event], None] | None = None,
            ) -> np.ndarray | None:
        """Run the batch (its sequence ids are the lane's) and return its logits rows, a view valid
        until the lane's next pass (None when the batch asked for none). `solo`: in a pass of its
        own, computed exactly as when the lane decodes alone. `meanwhile(done)`, for a lane of its
        own on a context whose work runs elsewhere: called while the pass runs (beside it:
        engine.compute.start_beside), `done` set when the pass has ended; through a gate, while a
        pass of this batch alone runs, or for a share of a pass shared with others (PassGate._run)."""
        if self.gate is None:
            self.pass_s = _decode(self.ctx, batch, meanwhile)
            self.shared, self.pass_tokens = 1, batch.n_tokens
            self.last_batch = (int(batch.positions[0]), batch.n_tokens, 0)
            return self.ctx.logits() if batch.want_logits[: batch.n_tokens].any() else None
        handed = self.gate.decode(self, batch, solo, meanwhile)
        self.shared, self.pass_s, self.pass_tokens = handed.shared, handed.seconds, handed.tokens
        self.new_count = handed.new_count
        self.last_batch = (int(batch.positions[0]), batch.n_tokens, handed.offset)
        return handed.rows

    @property
    def may_run_alone(self) -> bool:
        """Whether this lane's passes may run at once now: it has no gate, or every request waits
        for a pass of another context that runs elsewhere (PassGate._run's `meanwhile`)."""
        return self.gate is None or self.gate.room.running

    @contextlib.contextmanager
    def alone(self):
        """Run this lane's passes at once, not through its gate, for the while: only where no
        other pass of its context can start (every request waits at another context's gate, in a
        pass that runs elsewhere: PassGate._run's `meanwhile`)."""
        gate, self.gate = self.gate, None
        try:
            yield
        finally:
            self.gate = gate

    def budget(self, wanted: int) -> int:
        """Tree nodes this lane may verify per pass: what it wants, within its share of the batch
        among the lanes decoding now. (Its sequence ids, one per leaf, cap a tree's leaves, not
        its nodes: SpeculativeDecoder verifies the best part of a tree that has more.)"""
        cap = wanted
        if self.gate is not None:
            cap = min(cap, self.gate.share())
        return max(0, cap)

    def keep(self, seq: int, used: int | None = None) -> None:
        """Drop every sequence of the lane but `seq` (of the first `used` ones, where only those
        were written)."""
        if self.whole:
            self.ctx.seq_keep(seq)
            return
        for s in self.seqs[:used] if used is not None else self.seqs:
            if s != seq:
                self.ctx.seq_rm(s, -1, -1)

    def cut(self, n: int) -> None:
        """Drop positions n.. from every sequence of the lane."""
        if self.whole:
            self.ctx.seq_rm(-1, n, -1)
            return
        for s in self.seqs:
            self.ctx.seq_rm(s, n, -1)

    def clear(self) -> None:
        """Empty the lane's sequences."""
        if self.whole:
            self.ctx.clear()
            return
        for s in self.seqs:
            self.ctx.seq_rm(s, -1, -1)

    def join(self) -> None:
        """A request takes this lane: from now on no pass starts until it waits at a gate (or
        leaves), and a pass that runs now is waited for, so its cache edits never meet a pass."""
        if self.gate is not None:
            self.gate.join(self)

    def leave(self) -> None:
        """This lane decodes no more for now (its request ended): the others' passes go on
        without it. It joins again at its next pass."""
        if self.gate is not None:
            self.gate.leave(self)


@dataclass(eq=False)
class _Handed:
    """A batch handed to the gate, and what came of it."""

    batch: Batch
    solo: bool
    kind: int = 0  # steps of one kind may share a pass (a recurrent state: tokens per sequence)
    rows: np.ndarray | None = None
    shared: int = 0
    seconds: float = 0.0
    offset: int = 0  # where its first token sat in the pass's batch
    tokens: int = 0  # tokens the pass held, every request's
    new_count: bool = False  # the pass met a count of tokens new to the process, over RPC workers (pay.counts)
    meanwhile: Callable[[threading.Event], None] | None = None  # run beside the pass (Lane.run, PassGate._run)
    error: BaseException | None = None
    done: bool = False


class _Share:
    """A pass's end, or a deadline before it: the part of a pass one request's draft grows in."""

    def __init__(self, done: threading.Event, deadline: float):
        self.done, self.deadline = done, deadline

    def is_set(self) -> bool:
        return self.done.is_set() or time.perf_counter() >= self.deadline


class Room:
    """Where the gates of one set of requests meet (see the module doc): its members are the
    requests decoding now, each waiting at one gate or busy in its own thread."""

    def __init__(self):
        self.cond = threading.Condition()
        self.members: set[object] = set()
        self.gates: list[PassGate] = []  # in the order they are served: draft gates first
        self.running = False
        # What each request put into its latest passes and took out of them, recent steps
        # weighing most (`post`, from pay.steps.StepSizer): (tokens a pass, tokens emitted a pass).
        self.posts: dict[object, tuple[float, float]] = {}

    @property
    def active(self) -> int:
        """Requests decoding now."""
        return len(self.members)

    def post(self, owner: object, tokens: float, emitted: float) -> None:
        """Say what `owner`'s steps put into a pass and emitted from it lately (for `beside`)."""
        with self.cond:
            self.posts[owner] = (tokens, emitted)

    def beside(self, owner: object) -> tuple[float, float]:
        """Tokens a pass and tokens emitted a pass, summed over the requests decoding now but
        `owner` (one that has posted nothing yet counts as a plain step: one and one)."""
        with self.cond:
            others = [self.posts.get(m, (1.0, 1.0)) for m in self.members if m is not owner]
        return sum(t for t, _ in others), sum(e for _, e in others)

    def ready(self) -> bool:
        """Whether a pass may run now: none runs and every member waits at a gate (holding the lock)."""
        return not self.running and sum(len(g._waiting) for g in self.gates) >= len(self.members)

    def lead(self) -> None:
        """Run the next pass: the first gate's (in serving order) that has batches waiting."""
        for gate in self.gates:
            if gate._waiting:
                gate._lead()
                return


class PassGate:
    """Where the lanes of one context meet to share its passes (see the module doc)."""

    def __init__(self, ctx: Context, room: Room | None = None, first: bool = False):
        self.ctx = ctx
        self.room = room if room is not None else Room()
        if first:
            self.room.gates.insert(0, self)
        else:
            self.room.gates.append(self)
        self._batch = ctx.new_batch(ctx.n_batch, MAX_SEQ)
        self._cond = self.room.cond
        self._waiting: dict[Lane, _Handed] = {}
        self._last_solo = False
        self._last_s = 0.0  # the last shared pass's seconds (the share of it each request's draft grows in)
        self.shared_passes = 0  # passes that held several requests (for tests and stats)

    @property
    def active(self) -> int:
        """Requests decoding now."""
        return self.room.active

    def share(self) -> int:
        """Tree nodes one lane may verify per pass when every active lane grows a tree: its share of
        the batch, less its pending token."""
        return max(0, self.ctx.n_batch // max(1, self.room.active) - 1)

    def join(self, lane: Lane) -> None:
        with self._cond:
            # A member at once (the pass that runs now is the last before it waits at a gate),
            # then the end of that pass.
            self.room.members.add(lane.owner)
            self._cond.wait_for(lambda: not self.room.running)

    def leave(self, lane: Lane) -> None:
        with self._cond:
            self.room.members.discard(lane.owner)
            self._cond.notify_all()

    def decode(self, lane: Lane, batch: Batch, solo: bool,
               meanwhile: Callable[[threading.Event], None] | None = None) -> _Handed:
        """Hand the lane's batch in and wait for its pass; return what came of it (its logits rows,
        how many requests the pass held, the seconds it took, where the batch's first token sat in
        the pass, how many tokens it held in all). A failed pass raises its error in every lane it
        held."""
        handed = _Handed(batch, solo, self._kind(batch) if self.ctx.chains_only else 0, meanwhile=meanwhile)
        room = self.room
        with self._cond:
            room.members.add(lane.owner)
            self._waiting[lane] = handed
            self._cond.notify_all()
            while not handed.done:
                if room.ready():
                    room.lead()
                else:
                    self._cond.wait()
        if handed.error is not None:
            raise handed.error
        return handed

    # -- the lane whose arrival completed the set runs the pass (holding the condition's lock,
    # which it lets go while llama.cpp decodes) --
    def _lead(self) -> None:
        # (a split cache's pass is one ubatch only where its sequences ascend one by one)
        chosen = sorted(self._choose(), key=lambda lane: lane.base)
        handed = [self._waiting.pop(lane) for lane in chosen]
        self.room.running = True
        self._cond.release()
        try:
            self._run(handed, chosen)
        except BaseException as e:  # every request in the pass gets the error
            for h in handed:
                h.error = e
        finally:
            self._cond.acquire()
            self.room.running = False
            for h in handed:
                h.done = True
            self._cond.notify_all()

    def _choose(self) -> list[Lane]:
        """The lanes of the next pass: the steps that fit one batch, oldest first; every other
        pass while a solo batch waits, that batch alone."""
        steps = [lane for lane, h in self._waiting.items() if not h.solo]
        solos = [lane for lane, h in self._waiting.items() if h.solo]
        if solos and (not steps or not self._last_solo):
            self._last_solo = True
            # The smallest first: a short prompt is not kept behind a long one's chunks.
            return [min(solos, key=lambda lane: self._waiting[lane].batch.n_tokens)]
        self._last_solo = False
        kind = self._waiting[steps[0]].kind
        chosen, room = [], self.ctx.n_batch
        for lane in steps:
            handed = self._waiting[lane]
            if handed.kind != kind or (kind < 0 and chosen):  # (-1: a batch of its own)
                continue
            if handed.batch.n_tokens <= room or not chosen:
                chosen.append(lane)
                room -= handed.batch.n_tokens
        return chosen

    @staticmethod
    def _kind(batch: Batch) -> int:
        """Tokens per sequence where every sequence of the batch holds as many (-1: they differ)."""
        _, counts = np.unique(batch.seq_ids[: batch.n_tokens, 0], return_counts=True)
        return int(counts[0]) if (counts == counts[0]).all() else -1

    def _run(self, handed: list[_Handed], lanes: list[Lane]) -> None:
        met = met_counts(self.ctx.model) if self.ctx.network_s else None
        if len(handed) == 1:
            h = handed[0]
            # (Where the pass runs elsewhere every request waits for it: the draft model reads the
            # request's prompt or grows its tree on meanwhile, Lane.alone, as alone.)
            h.seconds, h.shared, h.tokens = _decode(self.ctx, h.batch, h.meanwhile), 1, h.batch.n_tokens
            h.rows = self.ctx.logits() if h.batch.want_logits[: h.batch.n_tokens].any() else None
            h.new_count = met is not None and h.tokens not in met.counts  # (its lane notes the count)
            return
        self.shared_passes += 1
        big, n = self._batch, 0
        for h in handed:
            h.batch.copy_to(big, n)
            n += h.batch.n_tokens
        big.n_tokens = n
        filler = self._fill(big, handed, lanes, met)
        growing = [h.meanwhile for h in handed if h.meanwhile is not None]

        def grow(done: threading.Event) -> None:
            # The pass runs elsewhere and every request waits for it: each request's draft grows
            # its tree on meanwhile (Lane.alone), for a share of the pass's time.
            t0 = time.perf_counter()
            for i, meanwhile in enumerate(growing):
                meanwhile(_Share(done, t0 + self._last_s * (i + 1) / len(growing)))

        seconds = self._last_s = _decode(self.ctx, big, grow if growing else None)
        if filler is not None:
            self.ctx.seq_rm(*filler, -1)
        new_count = met is not None and big.n_tokens not in met.counts
        if met is not None:
            met.note(big.n_tokens, seconds, rows=int(big.want_logits[: big.n_tokens].sum()))
        logits = self.ctx.logits() if big.want_logits[:n].any() else None
        row = offset = 0
        for h in handed:
            wanted = int(h.batch.want_logits[: h.batch.n_tokens].sum())
            h.rows = logits[row: row + wanted] if wanted else None
            h.shared, h.seconds, h.offset, h.tokens, h.new_count = len(handed), seconds, offset, big.n_tokens, new_count
            row += wanted
            offset += h.batch.n_tokens

    def _fill(self, big: Batch, handed: list[_Handed], lanes: list[Lane],
              met: MetCounts | None) -> tuple[int, int] | None:
        """Add filler tokens to a shared pass over RPC workers (`met`: the model's counts there,
        None elsewhere); return (sequence, position) from which they sit, to be given back after
        the pass (None: no filler).

        A pass over a count of tokens not met before in the process costs round trips there
        (decoding.pay.counts), and a shared pass holds the sum of its requests' trees: counts
        each tree's own shape (SpeculativeDecoder._network_shape) does not keep few. So the pass
        is filled as a prompt's is (kv.CachedSequence._fill): to a count met before where that
        pays, else to a tree pass's. The filler sits after the tokens of the request with the most
        room, in its first sequence, on from its last position there: no token of any request
        attends to it. Some of it asks rows of logits where the pass's own count of rows was never
        asked before (MetCounts.rows_for). A pass under TILE_ROWS stays under it."""
        ctx, n = self.ctx, big.n_tokens
        if met is None or ctx.chains_only or ctx.window:
            return None  # (a recurrent state would take the filler in; a window-sized cache could drop cells for it)
        # Cells a request holds in the pass: its committed text (before its batch's first
        # position) and the batch's tokens; a request's lane bounds them.
        rooms = [lane.n_ctx - int(h.batch.positions[0]) - h.batch.n_tokens for lane, h in zip(lanes, handed)]
        pick = int(np.argmax(rooms))
        fill = fill_count(ctx, n, n + min(rooms[pick], big.capacity - n))
        if fill <= 0:
            return None
        batch, seq = handed[pick].batch, lanes[pick].base
        # (llama.cpp takes a sequence's positions in a batch only where they run on unbroken:
        # the filler goes on from the last of the tokens in that sequence, not of the batch.)
        ids, k = batch.seq_ids[: batch.n_tokens], batch.n_seq[: batch.n_tokens, None]
        in_seq = ((ids == seq) & (np.arange(ids.shape[1]) < k)).any(axis=1)
        start = int(batch.positions[: batch.n_tokens][in_seq].max()) + 1
        token = int(batch.tokens[batch.n_tokens - 1])
        # The last layer computes the rows of logits asked for only: filler rows ask for some
        # where the pass's own rows are a count no pass asked for before (rows_for).
        rows = int(big.want_logits[:n].sum())
        asked = met.rows_for(rows, rows + fill) - rows
        for i in range(fill):
            big.add(token, start + i, (seq,), i < asked)
        return seq, start
