"""The committed text in a context's KV cache (sequence 0), reused across calls."""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

import numpy as np

from specrun.decoding.batching import TILE_ROWS, Lane, fill_count
from specrun.decoding.pay.counts import met_counts
from specrun.engine import Batch, chains_may_match, list_devices, llama_version_info, system_info
from specrun.errors import ContextFullError, EngineError, UsageError
from specrun.files import file_key
from specrun.records import Records

# A pass resumed inside a batch starts this many tokens after the batch's start, or a multiple: CPU
# kernels that take tokens in groups (repacked K-quants take four at a time) then group each token
# as a fresh prefill's pass does.
RESUME_ALIGN = 32


class CachedSequence:
    """Tracks the tokens held in sequence 0 of a context's KV cache and reuses them across calls.

    The last token of a prompt is kept out of the cache: it is the "pending" token the next
    forward pass starts from (for speculation, the root of the first tree).

    A model with a recurrent state (hybrid or pure recurrent) holds only the state after its last
    token: a cached text is reused only when it is a prefix of the new one, otherwise the cache
    starts over; and rejected drafts are rolled back only as llama.cpp does it exactly (see
    `roll_back`).

    Prompts are decoded in batches that end at multiples of the batch size, counted from the start
    of the text, whatever the cache already held. llama.cpp's kernels round differently for
    batches of different sizes, so a token's KV and logits depend in their last digits on the batch
    it was decoded in: with the batches fixed by position, a whole batch's worth of prompt decoded
    once holds exactly what any later prefill of a prompt starting the same way would compute
    (`n_exact` tokens), and an exact `sync` reuses only that (see `reusable`). A prompt prefilled so
    keeps its last row too: the same prompt again (an answer regenerated, a request retried) decodes
    nothing while the cache still holds it as that prefill wrote it.

    Where passes of TILE_ROWS tokens or more were measured to round a token alike whatever follows
    it in the pass (`resumes_alike`, on a context of the request's own), a prompt that parts from a
    cached one inside a batch keeps the cached tokens up to there too, when they were decoded in a
    pass of that many tokens (`n_tiled`), and decodes the rest of that batch in one pass of that many
    (going back as far as needed): what a fresh prefill computes, bit for bit.
    """

    def __init__(self, ctx, batch, lane: Lane | None = None):
        self.ctx = ctx
        self.batch = batch
        # The request's share of the context (decoding.batching): all of it, unless several
        # requests decode together.
        self.lane = lane if lane is not None else Lane(ctx)
        self.tokens: list[int] = []
        # The sequence holding the text: the lane's first, except after a hybrid target accepted a
        # chain scored in another of its sequences (its state rolls back exactly only where it was made).
        self.seq = self.lane.base
        # The logits row of the prompt's last token, after a sync that decoded it (a view, valid
        # until the next pass).
        self.logits = None
        # Leading tokens whose KV a fresh prefill would compute the same: decoded in whole batches
        # that start at multiples of the batch size, from exact KV.
        self.n_exact = 0
        # Leading tokens whose KV a fresh prefill would compute the same where its passes there hold
        # TILE_ROWS tokens or more: n_exact's, then, in the batch after, tokens decoded in one such
        # pass from exact KV (or on from there). Used only where the context rounds so (`resumes_alike`).
        self.n_tiled = 0
        self._resumes: bool | None = None  # resumes_alike's answer, once asked
        # Where the last prefill ended: the tokens after it were written by decoding steps.
        self.prompt_end = 0
        # The text's length when a window-sized cache last gave back the cells behind its window.
        self.compacted = 0
        # The last prompt prefilled and a copy of its last row: the same prompt again (an answer
        # regenerated, a request retried) takes that row and decodes nothing, while the cache
        # still holds the prompt as that prefill wrote it. `_last_exact`: that prefill computed
        # what an exact sync computes for it (a fresh prefill's, or a conversation's next turn
        # on its answer's KV), so a greedy request may take the row too.
        self._last_prompt: tuple[int, ...] = ()
        self._last_row = None
        self._last_exact = False

    @property
    def n_cached(self) -> int:
        return len(self.tokens)

    def sync(self, prompt: Sequence[int], include_last: bool = False, exact: bool = False,
             keep_row: bool = False, meanwhile: Callable[[threading.Event], None] | None = None,
             joins: bool = False) -> tuple[int, int, float]:
        """Make the cache hold prompt[:-1]; return (pending token, tokens prefilled, seconds).

        With include_last the last token is decoded too (in the same batch as the rest of the new
        tokens), and its logits are left in the context. With `exact` the prompt's KV and logits are
        what a prefill into an empty cache computes, where that costs less than a batch (see
        `reusable`). With `keep_row` (and include_last) a copy of the last row is kept for the same
        prompt again: a request's prompt, not a draft's catch-up, whose text grows every step.
        `meanwhile(done)` runs beside each of the prefill's passes (Lane.run). With `joins` (see
        `joins`) the prefill's passes may hold other requests' steps, and nothing is asked to be
        exact (`exact` is then ignored).
        """
        if not prompt:
            raise UsageError("the prompt is empty (no tokens to start from)")
        if len(prompt) >= self.lane.n_ctx:
            raise ContextFullError(
                f"the prompt has {len(prompt)} tokens but the context holds {self.lane.n_ctx}; "
                "use a larger --ctx-size or a shorter prompt"
            )
        exact = exact and not joins
        keep = self.reusable(prompt, exact)
        # An exact sync that keeps more than the last prefill wrote runs on into an answer's KV.
        next_turn = exact and keep > self.prompt_end
        t0 = time.perf_counter()
        if keep == len(prompt):  # the prompt prefilled last, whole: its row is kept
            row = self._last_row
            self.truncate(keep if include_last else keep - 1)  # (without: the caller decodes the last token)
            self.logits = row
            self.prompt_end = self.n_cached
            return prompt[-1], 0, time.perf_counter() - t0
        self.truncate(keep)
        # From exact KV at a batch boundary the prefill runs on the grid a fresh one takes: its KV
        # and its last row are what a prefill into an empty cache computes. So it does resumed inside
        # a batch, after tokens a pass of TILE_ROWS or more decoded, in a pass of as many. (Asked
        # only where a kept row needs it: a draft's catch-up never measures.)
        fresh = keep_row and ((keep % self.batch.capacity == 0 and self.n_exact == keep)
                              or self._resumed(keep, len(prompt)))
        todo = list(prompt[keep:]) if include_last else list(prompt[keep:-1])
        self.extend(todo, want_last_logits=include_last, meanwhile=meanwhile, joins=joins)
        self.prompt_end = self.n_cached
        if keep_row and include_last and self.logits is not None and not self.ctx.has_state:
            self._last_prompt, self._last_row = tuple(prompt), self.logits.copy()
            self._last_exact = (fresh or next_turn) and not joins
        return prompt[-1], len(todo), time.perf_counter() - t0

    def reusable(self, prompt: Sequence[int], exact: bool = False) -> int:
        """Return how many leading tokens of prompt the cache already holds and keeps (the last
        prompt token is always decoded again: its logits start the generation).

        `exact` keeps only what a fresh prefill would compute the same, where the prompt parts
        from the cached text inside an earlier prompt: the shared part is cut back to the last
        multiple of the batch size, fewer than a batch of tokens to decode again, or where that
        batch's cached tokens came from a tiled pass, to a multiple of RESUME_ALIGN inside it
        that leaves the rest of the batch a pass of TILE_ROWS tokens at least (see the class
        doc). Where it runs on into a previous answer (the next turn of a conversation), that
        answer's KV came from decoding steps, which no prefill computes the same: it is kept (as
        it is on a recurrent state, which cannot be cut back).

        A window-sized cache (engine.Context.window) is cut back only where it still holds the
        window before the cut; elsewhere nothing is reused, as llama.cpp's server does.

        The prompt last prefilled, still held as written: all of it (its last row was kept, and
        sync decodes nothing); for an exact sync, only where that prefill was one itself (on the
        batch grid, or a next turn on an answer's KV): the same request gets the same logits."""
        if self._holds_last_prompt(prompt) and (self._last_exact or not exact):
            return len(prompt)  # all of it, its last row too (sync)
        keep, limit = 0, min(len(self.tokens), len(prompt) - 1)
        while keep < limit and self.tokens[keep] == prompt[keep]:
            keep += 1
        if self.ctx.has_state:
            return keep if keep == len(self.tokens) else 0  # a recurrent state cannot go back to an earlier prefix
        aligned = keep - keep % self.batch.capacity
        if exact and keep <= self.prompt_end and aligned <= self.n_exact:
            # Inside the batch, as far as its cached tokens were decoded in a tiled pass, leaving the
            # rest of the batch a pass of TILE_ROWS tokens at least (see the class doc).
            resume = min(keep, self.n_tiled, min(aligned + self.batch.capacity, len(prompt)) - TILE_ROWS)
            resume -= (resume - aligned) % RESUME_ALIGN
            keep = resume if resume > aligned and self._resumed(resume, len(prompt)) else aligned
        if keep < len(self.tokens) and not self.ctx.can_cut(self.seq, keep):
            return 0  # a window-sized cache no longer holds the window before the cut: start over
        return keep

    def _resumed(self, keep: int, n: int) -> bool:
        """Whether a prefill of n tokens resumed after `keep` computes a fresh prefill's KV and last
        row: inside a batch whose first tokens were decoded exactly (n_exact), the rest of that batch
        one pass of TILE_ROWS tokens at least, on a context of this request's own whose passes were
        measured to round so (`resumes_alike`, asked once)."""
        size = self.batch.capacity
        aligned = keep - keep % size
        if (keep == aligned or (keep - aligned) % RESUME_ALIGN or self.n_exact < aligned or self.n_tiled < keep
                or min(aligned + size, n) - keep < TILE_ROWS):
            return False
        return self.measure_resumes()

    def measure_resumes(self) -> bool:
        """Whether this cache may resume a prefill inside a batch (see `_resumed`): measured once
        (`resumes_alike`), on a context of its own; a server asks before its first request."""
        if self.lane.gate is not None or self.ctx.has_state or self.ctx.window:
            return False  # other requests' cells: a resumed pass need not land where a fresh one would
        if self._resumes is None:
            self._resumes = resumes_alike(self.ctx, self.seq, self.n_cached, self.lane.n_ctx)
        return bool(self._resumes)

    def _holds_last_prompt(self, prompt: Sequence[int]) -> bool:
        """Whether `prompt` is the last prompt prefilled (see sync) and the cache still holds it as
        that prefill wrote it (nothing before its end cut since, and a window-sized cache can
        still go back to it)."""
        n = len(prompt)
        return (n > 0 and len(self._last_prompt) == n and len(self.tokens) >= n and self._last_prompt == tuple(prompt)
                and (len(self.tokens) == n or self.ctx.can_cut(self.seq, n)))

    def reused(self, prompt: Sequence[int], params) -> int:
        """Return how many leading tokens of prompt a request sampled with `params` (a
        core.sampling.SamplingParams) takes from the cache: none for a reproducible one, which
        prefills afresh; else what `reusable` keeps, exactly so for a greedy one unless its
        prompt `joins` other requests' passes."""
        return 0 if params.reproducible else self.reusable(prompt, params.exact_prefill and not self.joins(params))

    def joins(self, params) -> bool:
        """Whether the prompt of a request sampled with `params` goes in passes that may hold other
        requests' steps (--throughput: Lane.prompts_join; never a reproducible request's). Its KV
        and last row then differ in their last digits from a prefill's alone, so nothing asks
        for those: any cached prefix is reused, as for a sampled request."""
        return self.lane.prompts_join and not params.reproducible

    def truncate(self, n: int) -> None:
        """Drop everything from position n on, in every sequence."""
        self._forget_from(n)
        if self.ctx.has_state:
            if n == 0:  # llama.cpp's recurrent memory refuses seq_rm over all sequences
                self.lane.clear()
                self.tokens.clear()
                self.seq = self.lane.base
                return
            if n < len(self.tokens):
                raise EngineError(f"a recurrent state cannot be cut back from {len(self.tokens)} to {n} tokens")
            self.lane.keep(self.seq)  # nothing to drop from the text; stale draft sequences go
            return
        self.lane.cut(n)
        del self.tokens[n:]

    def roll_back(self, n_keep: int, last_decode: int) -> None:
        """Keep the first n_keep tokens of sequence 0, dropping what the last decode added beyond.

        A recurrent state rolls back exactly only when the last decode held more tokens than are
        dropped (its snapshots come from that decode), and llama.cpp says yes even when it is
        wrong: so this refuses anything else instead of trusting the return value.
        """
        drop = len(self.tokens) - n_keep
        if drop <= 0:
            return
        if self.ctx.has_state and (drop >= last_decode or drop > self.ctx.n_rs_seq):
            raise EngineError(f"cannot roll a recurrent state back by {drop} tokens after a decode of {last_decode}")
        if not self.ctx.can_cut(self.seq, n_keep):
            raise EngineError(f"a window-sized cache cannot be rolled back by {drop} tokens")
        self.ctx.seq_rm(self.seq, n_keep, -1)
        del self.tokens[n_keep:]
        self._forget_from(n_keep)

    def clear(self) -> None:
        """Empty the lane (every sequence of it) and forget its text."""
        self.lane.clear()
        self.tokens.clear()
        self.seq = self.lane.base
        self._forget_from(0)

    def _forget_from(self, n: int) -> None:
        if n < len(self._last_prompt):
            self._last_prompt, self._last_row = (), None
        self.n_exact = min(self.n_exact, n)
        self.n_tiled = min(self.n_tiled, n)
        self.prompt_end = min(self.prompt_end, n)
        self.compacted = min(self.compacted, n)

    def share_window(self) -> None:
        """Make room in a window-sized cache before the text is shared with tree colours.

        While the text is in several sequences, llama.cpp reuses none of its cells, so each tree
        step's accepted tokens take new ones and the cells behind the window stay taken. llama.cpp
        sizes such a cache at a window per sequence (and a batch): the lane's window and its tokens
        since the cells behind it were last given back must fit its sequences' share, one window
        each, so they are given back before they would not (engine.Context.compact_window)."""
        window = self.ctx.window
        if window and self.n_cached - self.compacted > (len(self.lane.seqs) - 1) * window:
            self.ctx.compact_window(self.seq)
            self.compacted = self.n_cached

    def extend(self, tokens: Sequence[int], want_last_logits: bool = False,
               meanwhile: Callable[[threading.Event], None] | None = None, until: threading.Event | None = None,
               joins: bool = False) -> None:
        """Decode tokens into the sequence in batches that end at multiples of n_batch (counted from
        the text's start, as a prefill into an empty cache does), each in a pass of its own.
        `meanwhile(done)` runs beside each pass (Lane.run); once `until` is set no further batch
        starts (the rest stays to decode). With `joins`, batches of half that size that go into
        passes with other requests' steps (Lane.prompts_join): no KV of theirs is a fresh prefill's."""
        step = max(1, self.batch.capacity // 2) if joins else self.batch.capacity
        done = 0
        while done < len(tokens) and not (until is not None and until.is_set()):
            start = self.n_cached
            chunk = tokens[done : done + step - start % step]
            done += len(chunk)
            last = done == len(tokens)
            self.batch.set_sequence(chunk, start, self.seq, "last" if (want_last_logits and last) else "none")
            filled = self._fill(len(chunk), start) if not joins else 0
            rows = self.lane.run(self.batch, solo=not joins, meanwhile=meanwhile)
            if filled:
                self.ctx.seq_rm(self.seq, start + len(chunk), -1)
            if self.ctx.network_s and not joins:  # (a pass of its own: its count is the chunk's, filled)
                met_counts(self.ctx.model).note(len(chunk) + filled, self.lane.pass_s, rows=int(want_last_logits and last))
            if rows is not None:
                self.logits = rows[-1]
            self.tokens.extend(chunk)
            if joins:
                continue
            if start == self.n_exact and len(chunk) == step:  # a whole batch, from exact KV and at a batch boundary
                self.n_exact = self.n_tiled = self.n_cached
            elif len(chunk) >= TILE_ROWS and start == self.n_tiled and start % step % RESUME_ALIGN == 0:
                # A tiled pass from exact KV (or on from one in its batch): what a fresh prefill's pass
                # of TILE_ROWS tokens or more computes, the whole batch where it ends one.
                if self.n_cached % step == 0:
                    self.n_exact = self.n_tiled = self.n_cached
                else:
                    self.n_tiled = self.n_cached

    def _fill(self, n: int, start: int) -> int:
        """Filler tokens after a prompt's chunk of n tokens from `start` in the batch (0: none).

        Where the target runs on RPC workers, a pass over a count of tokens not met before in
        the process costs round trips (decoding.pay.counts), and a prompt's length is new nearly
        every request: the chunk's pass is filled to a count met before where that pays, else to
        a count a tree's pass will meet (core.tree_shapes.NETWORK_PASSES), which it then meets
        for the trees. The filler sits after the chunk in its sequence and asks no logits, so no
        token of the chunk attends to it; its cells are given back after the pass. A chunk under TILE_ROWS stays
        under it (CPU attention takes its rows otherwise from there). Measured on a CPU, for F32
        and Q4_1 weights: the chunk's last row and its KV are then the chunk's alone, bit for bit
        (a K-quant's products sum by the pass's size: docs/exactness.md)."""
        ctx = self.ctx
        if not ctx.network_s or n < 2 or ctx.has_state or ctx.window:
            return 0  # (a recurrent state would take the filler in; a window-sized cache could drop cells for it)
        fill = fill_count(ctx, n, min(self.batch.capacity, self.lane.n_ctx - start))
        for i in range(fill):
            self.batch.add(self.batch.tokens[n - 1], start + n + i, (self.seq,), False)
        return fill

    def room(self) -> int:
        """Return how many more tokens fit in the context."""
        return self.lane.n_ctx - self.n_cached


def resumes_alike(ctx, seq: int, start: int, n_ctx: int) -> bool | None:
    """Measure whether this context computes a token alike in one pass with the tokens after it and
    in a pass resumed from it, where both hold TILE_ROWS tokens or more and the tokens before it were
    decoded in a longer pass and cut back (what CachedSequence's reuse inside a batch rests on;
    docs/exactness.md, "Prefill against prefill"): 131 tokens in one pass, against 100, cut back to
    64, and the 67 after in one pass; their last rows, and the rows of a two-token pass on their
    cells, compared bit for bit. In `seq` from position `start` on (after the text it holds, which
    is left as it was); None where the context has no room for it now, False where its batches
    are too small."""
    n, first, kept = TILE_ROWS + 2 * RESUME_ALIGN + 3, TILE_ROWS + 36, 2 * RESUME_ALIGN
    if ctx.n_batch < n:
        return False
    if n_ctx - start < n + 2:
        return None
    text = [(7 * i + 11) % ctx.n_vocab for i in range(n + 2)]
    batch = Batch(n, 1)

    def decode(begin: int, end: int, logits: str) -> None:
        batch.set_sequence(text[begin:end], start + begin, seq, logits)
        ctx.decode(batch)

    def outcome() -> tuple[np.ndarray, np.ndarray]:
        last = ctx.logits_row(-1).copy()
        decode(n, n + 2, "all")
        after = ctx.logits().copy()
        ctx.seq_rm(seq, start, -1)
        return last, after

    try:
        decode(0, n, "last")
        fresh = outcome()
        decode(0, first, "none")
        ctx.seq_rm(seq, start + kept, -1)
        decode(kept, n, "last")
        return all(np.array_equal(a, b) for a, b in zip(fresh, outcome()))
    except EngineError:
        return False
    finally:
        ctx.seq_rm(seq, start, -1)


# A tree's first path laid first in passes of these sizes, against one-token passes (chains_alike):
# (path tokens, pass tokens), a small tree's pass and one past flash attention's tiles (TILE_ROWS).
CHAIN_SHAPES = ((4, 8), (16, 72))
PATH_TOKENS, PASS_TOKENS = max(p for p, _ in CHAIN_SHAPES), max(n for _, n in CHAIN_SHAPES)
PREFIX = 8  # tokens in the cache before the path
# What chains_alike measured, per model file, build, placement and context options: each start of
# a run would otherwise pay it again (0.3-0.7 s on the demo models, more for a large one on a CPU).
CHAIN_RECORDS = Records("kernels", "kernel record", 256)
CHAINS_METHOD = 1  # (a change to the measurement leaves the records of the old one unread)


def chains_exact(ctx) -> bool:
    """Whether a greedy tree's first path, laid first in its pass, is scored on this target
    context with plain decoding's logits bit for bit, so that greedy trees verify as plain
    decoding (DraftTree.path_first, docs/exactness.md): measured (chains_alike) where its options
    may (engine.chains_may_match: a build that claims one kernel for every pass size, or a
    quantized cache); elsewhere it is not."""
    return chains_may_match(ctx.flash_attn, ctx.kv_type) and chains_alike(ctx)


def chains_alike(ctx) -> bool:
    """Whether this context scores a tree's first path, laid first in a pass with other branches
    after it, with the one-token passes' logits bit for bit, in each of CHAIN_SHAPES. Measured
    once per model file, build, placement and context options (kept in the cache folder), while
    the cache is empty (a run's start: nothing else decodes then); False where it cannot be.
    On the default build a Q4_1 target over a quantized cache does; an F32 one does not
    (tinyBLAS from two tokens), nor any over an f16 cache (tiled attention from 64 query rows).
    On a build without llamafile F32 and Q4_1 targets do, a Q4_K_M one does not."""
    known = getattr(ctx, "_chains_alike", None)
    if known is not None:
        return known
    if ctx.has_state or ctx.window or ctx.n_batch < PASS_TOKENS or ctx.n_seq_max < 2 or ctx.n_ctx < PREFIX + PASS_TOKENS:
        return False
    key = _chains_key(ctx)
    record = CHAIN_RECORDS.read(key) if key else None
    if record is not None and isinstance(record.get("alike"), bool):
        ctx._chains_alike = record["alike"]
        return ctx._chains_alike
    if any(ctx.seq_pos_max(seq) >= 0 for seq in range(ctx.n_seq_max)):
        return False  # (not kept: measured at the next start)
    began = time.perf_counter()
    alike = _measure_chains(ctx)
    ctx._chains_alike = alike
    if key:
        CHAIN_RECORDS.store(key, {"alike": alike, "seconds": round(time.perf_counter() - began, 3)})
    return alike


def _chains_key(ctx) -> dict | None:
    """What chains_alike's answer for `ctx` is kept under (None: its model file cannot be read)."""
    model = ctx.model
    try:
        file = file_key(model.path)
    except OSError:
        return None
    devices = [[d.name, d.description, d.host] for d in list_devices()] if model.offloaded else []
    return {"file": file, "placement": model.placement, "devices": devices, "llama": llama_version_info(),
            "system": system_info(), "flash_attn": ctx.flash_attn, "kv_type": ctx.kv_type, "threads": ctx.threads,
            "n_batch": ctx.n_batch, "shapes": CHAIN_SHAPES, "method": CHAINS_METHOD}


def _measure_chains(ctx) -> bool:
    """chains_alike's measurement: PREFIX tokens, then the path's tokens one a pass, then each
    shape's pass (the path on sequence 0 asking for its rows, branches on sequence 1), compared."""
    vocab = ctx.n_vocab
    prefix = [(7 * i + 11) % vocab for i in range(PREFIX)]
    path = [(7 * i + 11) % vocab for i in range(PREFIX, PREFIX + PATH_TOKENS)]
    branches = [(5 * i + 3) % vocab for i in range(max(n - p for p, n in CHAIN_SHAPES))]
    batch = Batch(PASS_TOKENS, 2)
    try:
        batch.set_sequence(prefix, 0, 0, "none")
        ctx.decode(batch)
        alone = []
        for i, token in enumerate(path):
            batch.set_sequence([token], PREFIX + i, 0, "last")
            ctx.decode(batch)
            alone.append(ctx.logits_row(-1).copy())
        for n_path, n_pass in CHAIN_SHAPES:
            ctx.seq_rm(0, PREFIX, -1)
            ctx.seq_rm(1, -1, -1)
            ctx.seq_cp(0, 1, -1, -1)
            batch.clear()
            for i, token in enumerate(path[:n_path]):
                batch.add(token, PREFIX + i, (0,), True)
            for j, token in enumerate(branches[: n_pass - n_path]):
                batch.add(token, PREFIX + j, (1,), False)
            ctx.decode(batch)
            if not all(np.array_equal(a, b) for a, b in zip(alone, ctx.logits()[:n_path])):
                return False
        return True
    except EngineError:
        return False
    finally:
        ctx.clear()


def probe_passes(cache: CachedSequence, sizes: Sequence[int], repeats: int = 1, logits: str = "last") -> dict[int, float] | None:
    """Seconds of one pass over n tokens, for each n of `sizes` (at most n_batch and what the
    context holds), asking for the `logits` of the last token or of all ('last', 'all'): the least
    of `repeats` timings, after a one-token pass that warms the model up. Needs an empty cache,
    and leaves it so (None when it holds text). Over RPC workers each pass is noted with the
    counts the model's passes met (pay.counts; a pass of all rows as a tree's): the passes that
    follow are filled to those counts, priced by these timings."""
    if cache.tokens:
        return None
    limit = min(cache.batch.capacity, cache.ctx.n_ctx - 1)

    def timed(n: int, noted: bool = True) -> float:
        cache.batch.set_sequence([0] * n, 0, cache.seq, logits)
        t0 = time.perf_counter()
        cache.ctx.decode(cache.batch)
        elapsed = time.perf_counter() - t0
        cache.truncate(0)
        if noted and cache.ctx.network_s:
            met_counts(cache.ctx.model).note(n, elapsed, tree=logits == "all", rows=n if logits == "all" else 1)
        return elapsed

    timed(1, noted=False)
    return {n: min(timed(n) for _ in range(repeats)) for n in sorted({max(1, min(n, limit)) for n in sizes})}


def probe_context(ctx, sizes: Sequence[int], repeats: int = 1, logits: str = "last") -> dict[int, float] | None:
    """probe_passes over a whole context, emptied first (a new decoder's cache starts empty; the
    probe leaves it so); None where the context cannot be probed."""
    try:
        ctx.clear()
        return probe_passes(CachedSequence(ctx, Batch(ctx.n_batch, 1)), sizes, repeats, logits)
    except EngineError:
        return None
