"""`--draft mtp`: the target's own MTP (next-token-prediction) layers draft a chain per step.

The MTP block (engine.mtp.MtpContext) predicts the token after next from a token and the
target's hidden row of the position before it. Its KV cache follows the committed text: token p
sits at position p, paired with the target's row p-1. Each step:

1. catch-up: the tokens committed since the last step and the new root go into the MTP context in
   one batch, each paired with the row the target's last pass computed for the position before
   it (the verify pass of the previous step; for the first step the prompt's prefill). The root's
   logits give the first draft and the block's own row;
2. each further draft is one MTP pass over (previous draft, the block's own row of it);
3. the drafts' cells are dropped at the next catch-up (they were fed the block's own rows, not the
   target's), what the target accepted is fed again with the target's rows.

Several requests draft in one MTP context, each drafter in a sequence of its own (its lane of
the MTP context). With --parallel N the lanes share the context's passes through a gate, as the
draft model's do (decoding.batching): the catch-ups of the requests drafting now run as one
pass, then each further draft of every chain; lanes of their own take turns under the context's
lock. The target rows a
drafter reads are its request's: in a target pass other requests share, its tokens start at its
lane's offset in the batch (decoding.batching.Lane.last_batch).

The drafts are only proposals: the target verifies every token (one chain per step), so the
output is exactly the target's whatever the MTP block proposes. Where a target row is not at hand
(the part of a long prompt prefilled in an earlier batch, a prefix reused from an earlier
request), a zero row stands in: those positions draft worse, nothing else changes.
"""

from __future__ import annotations

import contextlib
import time
from typing import Sequence

import numpy as np

from specrun.core.tree import DraftTree
from specrun.decoding.batching import Lane
from specrun.decoding.drafters.base import Drafter, Proposal
from specrun.engine import MtpContext, embeddings_nextn_row

# Tokens compared with the text before trusting the MTP cache to hold a prefix of it.
_TAIL_CHECK = 16
# Drafts per step when the plan names none: llama.cpp's own draft-mtp default.
DEFAULT_CHAIN = 3


class MtpDrafter(Drafter):
    """Proposes a chain of MTP drafts below the root; its MTP cache follows the committed text."""

    def __init__(self, mtp: MtpContext | Lane, chain: int = DEFAULT_CHAIN):
        """`mtp`: the MTP context, or this drafter's lane of it (a sequence of its own)."""
        self.lane = mtp if isinstance(mtp, Lane) else Lane(mtp)
        self.mtp: MtpContext = self.lane.ctx
        self.seq = self.lane.base
        self.target: Lane | None = None  # the target lane whose passes give the rows (attach)
        self.chain = chain
        self.n_embd = self.mtp.n_embd
        self.fed: list[int] = []  # tokens in the MTP cache with the target's rows (positions 0..)
        self._zero = np.zeros(self.n_embd, dtype=np.float32)
        self.batch = self.mtp.new_batch(self.mtp.n_batch)

    def _kept(self, text: Sequence[int]) -> int:
        """How many leading tokens of the MTP cache stay valid for `text`."""
        fed, n = self.fed, len(self.fed)
        if 0 < n <= len(text) and fed[-_TAIL_CHECK:] == list(text[max(0, n - _TAIL_CHECK) : n]):
            return n
        keep, limit = 0, min(n, len(text))
        while keep < limit and fed[keep] == text[keep]:
            keep += 1
        return keep

    def _target_rows(self, first: int, last: int) -> np.ndarray:
        """The target's rows of positions first..last-1 (zero rows where its request's last pass
        has none): the request's tokens of that pass lie at `offset`.. of its batch, in order."""
        start, n, offset = self.target.last_batch if self.target is not None else (0, 0, 0)
        rows = np.zeros((max(0, last - first), self.n_embd), dtype=np.float32)
        for p in range(max(first, start), min(last, start + n)):
            rows[p - first] = embeddings_nextn_row(self.target.ctx, offset + p - start, self.n_embd)
        return rows

    def _catch_up(self, text: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Feed text[keep:] (the root last) with the target's rows; return the root's (logits, row)."""
        keep = self._kept(text)
        self.mtp.seq_rm(self.seq, keep)  # also the drafts of the last step
        if keep == len(text):  # the root is already in (nothing was committed since): feed it again
            keep -= 1
            self.mtp.seq_rm(self.seq, keep)
        rows = self._target_rows(keep - 1, len(text) - 1)  # token p pairs with row p - 1
        if keep == 0:
            rows = np.vstack([self._zero, rows])  # the first token has no row before it
        step = self.mtp.n_batch
        out = None
        for a in range(keep, len(text), step):
            b = min(len(text), a + step)
            out = self._pass(text[a:b], a, rows[a - keep : b - keep], want_last=b == len(text))
        self.fed = list(text)
        return out

    def _pass(self, tokens: Sequence[int], pos0: int, rows: np.ndarray, want_last: bool):
        """One MTP pass of this drafter's tokens (through its lane: with other requests' where the
        lane shares the context's passes); with want_last, the last token's (logits, own row)."""
        self.batch.set_rows(tokens, pos0, rows, self.seq, want_last)
        logits = self.lane.run(self.batch)
        if not want_last:
            return None
        _, n, offset = self.lane.last_batch  # the row of its last token, by its place in the pass's batch
        return logits[-1].copy(), embeddings_nextn_row(self.mtp, offset + n - 1, self.n_embd)

    def propose(self, committed: Sequence[int], root: int, budget: int, depth: int) -> Proposal | None:
        k = min(self.chain, budget, depth)
        if k < 1:
            return None
        t0 = time.perf_counter()
        tokens = []
        with self._exclusive():
            logits, row = self._catch_up([*committed, root])
            pos = len(committed)
            for i in range(k):
                tokens.append(int(np.argmax(logits)))  # a chain: no scores to rank branches by
                if i + 1 < k:
                    logits, row = self._pass([tokens[-1]], pos + 1 + i, row[None, :], want_last=True)
        return Proposal(DraftTree.chain(root, tokens), draft_s=time.perf_counter() - t0, draft_passes=k)

    def commit(self, proposal: Proposal, accepted_nodes: Sequence[int]) -> None:
        pass  # the next catch-up feeds what was accepted, with the verify pass's rows

    def attach(self, lane: Lane) -> None:
        self.target = lane
        self.lane.owner = lane.owner  # one member of the gates' room with its request's target lane

    @property
    def drafts_beside_others(self) -> bool:
        # Its passes are its own (one request's chain, under the context's lock), small next to
        # a target pass: whether they pay beside other requests is measured in turns as shared
        # draft passes are (pay.together).
        return True

    def _exclusive(self):
        """Hold the context while this drafter edits its cache and runs its passes: through a gate
        no pass runs while its request is busy (decoding.batching), else under the context's lock
        (requests whose lanes run their own passes)."""
        return contextlib.nullcontext() if self.lane.gate is not None else self.mtp.lock

    def reset(self) -> None:
        with self._exclusive():
            self.lane.clear()
        self.fed.clear()
