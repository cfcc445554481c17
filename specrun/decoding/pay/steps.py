"""What a speculative decoder proposes each step, and at what size.

A step may verify at most what the plan's tree, the room left in the context and the request's
lane allow (the decoder's capacity); `StepSizer` cuts that to what pays: the speed guard of this
kind of request (greedy or sampled) caps it, down to plain steps, and now and then asks for a
plain step to measure plain decoding; a reproducible request decodes plainly, or in chains where
they verify bit for bit as plain decoding (`chains_exact`, greedy only). Within the size it
gives, a drafter proposes the tree its own hindsight says pays (rules.best_size), beside other
requests the tree that pays for what it adds to the pass they share (`beside`, `post`).
"""

from __future__ import annotations

import logging

from specrun.core.sampling import SamplingParams
from specrun.decoding.adaptive import Average
from specrun.decoding.pay.guard import SpeedGuard
from specrun.decoding.pay.rules import ALONE, POST_HALF_LIFE, Beside
from specrun.decoding.pay.together import Together
from specrun.decoding.steps import Step

log = logging.getLogger("specrun")


class StepSizer:
    """The size of each step of one decoder: `start` a request, ask `size` before each step,
    `record` each step that ran.

    One guard per kind of request (greedy, sampled): what sampled answers measured must not cut
    the trees of greedy ones. The guard given stands for the first kind seen, a copy (settings, no
    measurements) for the other. Without a guard (bench and tune measure trees as given) a step
    verifies what the decoder's capacity allows.
    """

    def __init__(self, guard: SpeedGuard | None = None, together: Together | None = None, chains_exact: bool = False):
        self.guard = guard  # the guard of the request under way
        # A chain verifies with plain decoding's logits bit for bit (engine.runs_batch_invariant):
        # a greedy reproducible request keeps speculation, its trees cut to their best path, or
        # whole where it has the cache to itself (a tree's first path is exact there too).
        self.chains_exact = chains_exact
        self._guards: dict[str, SpeedGuard] = {}
        self._told = False  # the guard's first event was said (at info level)
        # The turns of the requests decoding together (shared by their decoders' sizers).
        self.together = together
        self._turn: tuple[int, bool] | None = None  # (requests, drafting) of the step under way
        # This decoder's steps lately: [tokens each put into its pass, tokens it emitted] (post).
        self._mine = Average(POST_HALF_LIFE, 2)

    def start(self, params: SamplingParams) -> None:
        """A request begins: its kind's guard (a cut cap grows back: SpeedGuard.new_request)."""
        if self.guard is None:
            return
        kind = "sampled" if params.temperature > 0 else "greedy"
        if not self._guards:
            self._guards[kind] = self.guard
        elif kind not in self._guards:
            self._guards[kind] = self.guard.copy()
        self.guard = self._guards[kind]
        self.guard.new_request()

    def size(self, capacity: int, params: SamplingParams) -> int:
        """The most tree nodes this step proposes, of the `capacity` the decoder has (0: a plain step)."""
        if params.reproducible and not (params.greedy and self.chains_exact):
            return 0  # see SamplingParams.reproducible
        if self.guard is None:
            return capacity
        return 0 if self.guard.wants_plain_step() else min(capacity, self.guard.cap)

    def beside(self, lane) -> Beside:
        """What the other requests decoding beside this one put into the passes it shares with
        them lately (ALONE while none does): its drafter weighs its tree against that pass."""
        if not lane.sharing:
            return ALONE
        return Beside(*lane.gate.room.beside(lane.owner))

    def post(self, lane, step: Step) -> None:
        """Tell the requests decoding beside this one what its steps put into a pass (the root
        and its tree) and took out of it (the tokens they emitted), recent steps weighing most."""
        self._mine.add([step.tree_nodes + 1, len(step.tokens)])
        if lane.gate is not None:
            tokens, emitted = self._mine.mean
            lane.gate.room.post(lane.owner, float(tokens), float(emitted))

    def model_drafts(self, lane, drafter) -> bool:
        """Whether this step's proposal may cost model passes: alone, yes; beside other requests,
        where the drafter's draft passes are shared with theirs too and its turn drafts
        (together.Together); otherwise it proposes only what costs no model pass."""
        self._turn = None
        if not lane.sharing:
            return True
        if not drafter.drafts_beside_others or self.together is None:
            return False
        requests = lane.gate.room.active
        drafting = self.together.drafts(requests)
        self._turn = (requests, drafting)
        return drafting

    def record_together(self, step: Step, one_off: bool = False) -> None:
        """Take the tokens of a step made beside other requests (for their turns); `one_off`: it
        paid what no later step pays (its turn is measured from now)."""
        if self._turn is not None and self.together is not None:
            if one_off:
                self.together.restart(*self._turn)
            else:  # (what came without the draft model: the root, lookup's and forced tokens)
                self.together.record(*self._turn, len(step.tokens), free=1 + step.lookup_tokens + step.forced_tokens,
                                     pass_s=step.target_s)
        self._turn = None

    def record(self, step: Step) -> None:
        """Take a step's tokens, seconds and tree size (steps of passes this request had to
        itself only, and not an answer's first drafted step, which brings the draft up to the
        prompt: a one-off, like the target's prefill)."""
        guard = self.guard
        if guard is None:
            return
        # (A free tree accepted whole, a copy under way, pays for sure: the draft model's may not.)
        free_whole = step.accepted >= step.tree_depth and step.draft_s == 0
        guard.record(len(step.tokens), step.total_s, step.tree_nodes, whole=free_whole)
        for event in guard.events[guard.said :]:
            # Said once with --verbose; what follows (retries, further shrinking) at debug level.
            (log.debug if self._told else log.info)("%s", event)
            self._told = True
            guard.said += 1
