"""`--lookup`: the draft model's tree with lookup branches grafted on, which cost no draft pass.

Each step the lookup index proposes a tree from the session's text (decoding/lookup_index.py). Its best nodes
are grafted onto the draft model's tree (as many as measured acceptance and the target's cost per
extra verified token say pay, decoding/adaptive.py). When the text clearly repeats -- lookup alone has
been measured faster than draft tree + lookup -- the step leans on lookup and skips the draft
model's passes, running it again every few steps to keep measuring it.
"""

from __future__ import annotations

from typing import Sequence

from specrun.core.tree import MAX_LEAVES
from specrun.decoding.adaptive import Average, Hindsight, HindsightByKind, TargetCost
from specrun.decoding.drafters.base import Drafter, Proposal
from specrun.decoding.drafters.lookup import SessionText, lookup_proposal
from specrun.decoding.lookup_index import LookupIndex, cut, graft, new_by_rank

# Steps leaning on lookup alone before the draft model runs again (to measure it again).
_LEAN_REFRESH = 8


class HybridDrafter:
    """The draft model's tree plus lookup branches; leans on lookup while the text repeats."""

    def __init__(self, draft: Drafter, draft_budget: int, lookup_budget: int, index: LookupIndex | None = None,
                 cost: TargetCost | None = None, adapt: bool = True, draft_depth: int | None = None):
        self.draft = draft
        self.draft_budget = draft_budget
        self.draft_depth = draft_depth  # the draft model's tree stays as deep as planned (None: any)
        self.lookup_budget = lookup_budget
        self.text = SessionText(index, max_step=draft_budget + lookup_budget + 1)
        self.adapt = adapt
        self.with_draft = Hindsight(lookup_budget)  # lookup nodes grafted onto the draft tree
        self.alone = HindsightByKind(lookup_budget)  # the lookup tree alone, per kind of match
        self.cost = cost or TargetCost()
        self.draft_s = Average(24)  # draft-model seconds of a step that runs it
        self.step_s = Average(24)  # seconds of a step outside the target and draft passes
        self.chosen = lookup_budget  # lookup nodes the last step grafted (or verified alone)
        self.leaning = False  # the last step skipped the draft model
        self._lean_steps = 0
        self._lean_proposal: Proposal | None = None

    @property
    def index(self) -> LookupIndex:
        return self.text.index

    def learn(self, text: Sequence[int]) -> None:
        """Index a finished generation's text (prompt + answer) and finish watching its proposals."""
        self._read(text[:-1], text[-1])

    def _read(self, committed: Sequence[int], root: int) -> None:
        emitted = self.text.catch_up(committed, root)
        for hindsight in (self.with_draft, self.alone):
            if emitted is None:
                hindsight.forget_open()
            else:
                hindsight.feed(emitted)

    def propose(self, committed: Sequence[int], root: int, budget: int, depth: int) -> Proposal | None:
        self._read(committed, root)
        lookup_budget = min(self.lookup_budget, budget)
        branches = self.index.propose(self.index.live, lookup_budget, depth) if lookup_budget else None
        kind = self.alone.kind(self.index.last_order)
        alone = self.alone[kind]
        alone.watch(branches)
        self._lean_proposal = None
        self.leaning = branches is not None and self._should_lean(alone, long_run=kind[0] == 2)
        if self.leaning:
            self._lean_steps += 1
            self.chosen = self._best(alone, lookup_budget, draft_s=0.0)
            if self.chosen:
                self._lean_proposal = lookup_proposal(cut(branches, self.chosen))
                return self._lean_proposal
        self._lean_steps = 0
        self.leaning = False
        grown = self.draft.propose(committed, root, min(self.draft_budget, budget), min(self.draft_depth or depth, depth))
        self.draft_s.add(grown.draft_s)
        tree = grown.tree
        base_len = len(tree)
        room = budget - (base_len - 1)
        if branches is None or room < 1:
            self.with_draft.watch(None, base=tree)
            return grown
        self.with_draft.watch(branches, base=tree, new_by_rank=new_by_rank(tree, branches))
        self.chosen = min(room, self._best(self.with_draft, lookup_budget, draft_s=float(self.draft_s.mean)))
        if self.chosen:
            graft(tree, cut(branches, self.chosen), MAX_LEAVES)
            if len(tree) > base_len:
                grown.lookup_from = base_len
        return grown

    def _best(self, hindsight: Hindsight, budget: int, draft_s: float) -> int:
        if not self.adapt or not hindsight.known:
            return budget
        overhead = draft_s + (float(self.step_s.mean) if self.step_s.known else 0.0)
        best, _ = hindsight.best(lambda nodes: self.cost(nodes + 1) + overhead)
        return min(best, budget)

    def _should_lean(self, alone: Hindsight, long_run: bool) -> bool:
        """Whether lookup alone has been measured faster than the draft tree with lookup, for
        this kind of lookup proposal. Mid-copy the draft model rests: running it again would
        first have to bring it up to all the text copied since it last ran."""
        if not self.adapt or not (alone.known and self.with_draft.known):
            return False
        if self._lean_steps >= _LEAN_REFRESH and not long_run:
            return False
        step_s = float(self.step_s.mean) if self.step_s.known else 0.0
        _, alone = alone.best(lambda nodes: self.cost(nodes + 1) + step_s)
        _, hybrid = self.with_draft.best(lambda nodes: self.cost(nodes + 1) + step_s + float(self.draft_s.mean))
        return alone > hybrid

    def commit(self, proposal: Proposal, accepted_nodes: Sequence[int]) -> None:
        if proposal is not self._lean_proposal:
            self.draft.commit(proposal, accepted_nodes)  # grafted nodes are not in the draft's cache

    def observe(self, step) -> None:
        """Take one step's measurements (from the decoder)."""
        self.cost.observe(step.tree_nodes + 1, step.target_s)
        self.step_s.add(max(0.0, step.total_s - step.target_s - step.draft_s))

    def reset(self) -> None:
        self.draft.reset()
        self.with_draft.forget_open()
        self.alone.forget_open()
