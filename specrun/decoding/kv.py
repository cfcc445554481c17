"""The committed text in a context's KV cache (sequence 0), reused across calls."""

from __future__ import annotations

import time
from typing import Sequence

from specrun.errors import ContextFullError, EngineError, UsageError


class CachedSequence:
    """Tracks the tokens held in sequence 0 of a context's KV cache and reuses them across calls.

    The last token of a prompt is kept out of the cache: it is the "pending" token the next
    forward pass starts from (for speculation, the root of the first tree).

    A model with a recurrent state (hybrid or pure recurrent) holds only the state after its last
    token: a cached text is reused only when it is a prefix of the new one, otherwise the cache
    starts over; and rejected drafts are rolled back only as llama.cpp does it exactly (see
    `roll_back`).
    """

    def __init__(self, ctx, batch):
        self.ctx = ctx
        self.batch = batch
        self.tokens: list[int] = []
        # The sequence holding the text: 0, except after a hybrid target accepted a chain that
        # was scored in another sequence (its state rolls back exactly only where it was made).
        self.seq = 0

    @property
    def n_cached(self) -> int:
        return len(self.tokens)

    def sync(self, prompt: Sequence[int], include_last: bool = False) -> tuple[int, int, float]:
        """Make the cache hold prompt[:-1]; return (pending token, tokens prefilled, seconds).

        With include_last the last token is decoded too (in the same batch as the rest of the new
        tokens), and its logits are left in the context.
        """
        if not prompt:
            raise UsageError("the prompt is empty (no tokens to start from)")
        if len(prompt) >= self.ctx.n_ctx:
            raise ContextFullError(
                f"the prompt has {len(prompt)} tokens but the context holds {self.ctx.n_ctx}; "
                "use a larger --ctx-size or a shorter prompt"
            )
        keep = self.reusable(prompt)
        t0 = time.perf_counter()
        self.truncate(keep)
        todo = list(prompt[keep:]) if include_last else list(prompt[keep:-1])
        self.extend(todo, want_last_logits=include_last)
        return prompt[-1], len(todo), time.perf_counter() - t0

    def reusable(self, prompt: Sequence[int]) -> int:
        """Return how many leading tokens of prompt the cache already holds and keeps (the last
        prompt token is always decoded again: its logits start the generation)."""
        keep, limit = 0, min(len(self.tokens), len(prompt) - 1)
        while keep < limit and self.tokens[keep] == prompt[keep]:
            keep += 1
        if self.ctx.has_state and keep < len(self.tokens):
            return 0  # a recurrent state cannot go back to an earlier prefix: evaluate it again
        return keep

    def truncate(self, n: int) -> None:
        """Drop everything from position n on, in every sequence."""
        if self.ctx.has_state:
            if n == 0:  # llama.cpp's recurrent memory refuses seq_rm over all sequences
                self.ctx.clear()
                self.tokens.clear()
                self.seq = 0
                return
            if n < len(self.tokens):
                raise EngineError(f"a recurrent state cannot be cut back from {len(self.tokens)} to {n} tokens")
            self.ctx.seq_keep(self.seq)  # nothing to drop from the text; stale draft sequences go
            return
        self.ctx.seq_rm(-1, n, -1)
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
        self.ctx.seq_rm(self.seq, n_keep, -1)
        del self.tokens[n_keep:]

    def extend(self, tokens: Sequence[int], want_last_logits: bool = False) -> None:
        """Decode tokens into sequence 0 in chunks of n_batch."""
        step = self.batch.capacity
        for start in range(0, len(tokens), step):
            chunk = tokens[start : start + step]
            last = start + step >= len(tokens)
            self.batch.set_sequence(chunk, self.n_cached, self.seq, "last" if (want_last_logits and last) else "none")
            self.ctx.decode(self.batch)
            self.tokens.extend(chunk)

    def room(self) -> int:
        """Return how many more tokens fit in the context."""
        return self.ctx.n_ctx - self.n_cached


def probe_passes(cache: CachedSequence, sizes: Sequence[int], repeats: int = 1, logits: str = "last") -> dict[int, float] | None:
    """Seconds of one pass over n tokens, for each n of `sizes` (at most n_batch and what the
    context holds), asking for the `logits` of the last token or of all ('last', 'all'): the least
    of `repeats` timings, after a one-token pass that warms the model up. Needs an empty cache,
    and leaves it so (None when it holds text)."""
    if cache.tokens:
        return None
    limit = min(cache.batch.capacity, cache.ctx.n_ctx - 1)

    def timed(n: int) -> float:
        cache.batch.set_sequence([0] * n, 0, cache.seq, logits)
        t0 = time.perf_counter()
        cache.ctx.decode(cache.batch)
        elapsed = time.perf_counter() - t0
        cache.truncate(0)
        return elapsed

    timed(1)
    return {n: min(timed(n) for _ in range(repeats)) for n in sorted({max(1, min(n, limit)) for n in sizes})}
