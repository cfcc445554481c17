"""`--draft lookup`: a drafter with no model. Each step proposes a tree from what followed earlier
occurrences of the latest tokens in the session's text (decoding/lookup_index.py), cut to the budget that this
run's measurements say pays (decoding/adaptive.py); when nothing does, it proposes nothing and the step
costs what a plain step costs.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from specrun.core.tree import DraftTree
from specrun.decoding.adaptive import (
    REPEAT_MATCH,
    REPEAT_MIN,
    STRONG_ORDER,
    Average,
    Hindsight,
    HindsightByKind,
    TargetCost,
)
from specrun.decoding.drafters.base import Drafter, Proposal
from specrun.decoding.pay.rules import best_lookup_size
from specrun.decoding.lookup_index import LookupIndex, cut
from specrun.decoding.memory import OutputMemory

# Tokens compared with the index's copy of the text before indexing a step's tokens: a cheap
# check that the caller's text only grew; anything else is compared in full (LookupIndex.sync).
_TAIL_CHECK = 16
# While no budget pays, the full tree is proposed (to keep measuring) only every this many steps,
# unless the latest tokens match an earlier n-gram of STRONG_ORDER or more (a copy may be
# starting): free-form text then costs almost nothing over plain decoding.
_IDLE_SAMPLE = 4


def lookup_proposal(tree) -> Proposal:
    """A tree of lookup nodes only: no draft pass, no draft cache to keep."""
    return Proposal(tree, lookup_from=1)


class IdleSchedule:
    """When lookup looks at a proposal while no lookup tree pays and the text copies nothing:
    at every strong match (STRONG_ORDER tokens or more: the answer may be starting to copy), else
    every _IDLE_SAMPLE-th such step only (LookupDrafter, and the hybrid's steps that lean on
    lookup, so that leaning costs what lookup alone costs).

    Looking only at every fourth step, a fresh process's answer that quoted its prompt from the
    first token went 7 plain steps before its first tree (the demo pair's rewrites ran at 2.04x
    plain, against 2.44x looking at each strong match, in a simulation on recorded greedy answers);
    weak matches (the last token or two) in free text rarely pay, and skipping them keeps such
    text at plain decoding's speed."""

    def __init__(self):
        self._idle = 0  # idle steps since a lookup tree last paid

    def looks(self, idle: bool, strong: bool) -> bool:
        """Whether this step looks at a proposal; `idle`: no tree paid last step, no copy runs;
        `strong`: the latest tokens match an earlier n-gram of STRONG_ORDER tokens or more."""
        if not idle or strong:
            return True
        self._idle += 1
        return self._idle % _IDLE_SAMPLE == 0

    def paid(self) -> None:
        """A lookup tree was verified: look at every step again."""
        self._idle = 0


class SessionText:
    """The lookup index of a drafter's session, told what the caller's text became each step, and
    the memory of other requests' answers (decoding.memory; None: none) read beside it."""

    def __init__(self, index: LookupIndex | None = None, max_step: int = 2048, memory: OutputMemory | None = None):
        self.index = index if index is not None else LookupIndex()  # (an empty index is falsy)
        self.max_step = max_step
        self.memory = memory
        self._n_prompt = 0  # where the answer under way starts in its text

    def start(self, n_prompt: int) -> None:
        """A generation begins after a prompt of `n_prompt` tokens."""
        self._n_prompt = n_prompt

    def propose(self, budget: int, depth: int):
        """The lookup tree below the latest token: from the session's text and the memory."""
        return self.index.propose(self.index.live, budget, depth, memory=self.memory)

    def propose_after(self, committed: Sequence[int], root: int, forced: Sequence[int], budget: int,
                      depth: int) -> DraftTree | None:
        """The lookup tree below a grammar's forced run (Drafter.propose_after), where the index
        holds committed + [root] (the step's proposal read them) and the run's end matches earlier
        text at STRONG_ORDER tokens or more: a key of JSON the session or the memory wrote before.
        What `last_order` and `repeats` report stays the step's own proposal's."""
        live, index = self.index.live, self.index
        if not forced or len(live) != len(committed) + 1 or int(live[-1]) != root:
            return None
        said = index.last_order, index.last_match
        try:
            tree = index.propose(np.concatenate([live, np.asarray(forced, live.dtype)]), budget, depth,
                                 memory=self.memory)
            strong = index.last_order >= STRONG_ORDER
        finally:
            index.last_order, index.last_match = said
        return tree if strong else None

    @property
    def last_order(self) -> int:
        """The longest n-gram order the last proposal matched (0: none)."""
        return self.index.last_order

    def repeats(self, greedy: bool) -> bool:
        """Whether the last proposal continues a greedy request's repeat: its latest text equals
        earlier text, here or among the memory's answers, over REPEAT_MATCH tokens or more, or all
        of it from REPEAT_MIN tokens (a short prompt sent again)."""
        least = max(REPEAT_MIN, min(REPEAT_MATCH, len(self.index.live)))
        return greedy and self.index.last_match >= least

    def strong(self) -> bool:
        """Whether the latest tokens match an earlier n-gram of STRONG_ORDER tokens or more, in
        the session's text or among the memory's answers."""
        live = self.index.live
        if self.index.match_order(live, STRONG_ORDER) > 0:
            return True
        return self.memory is not None and self.memory.match_order(live, STRONG_ORDER) > 0

    def learn(self, text: Sequence[int], *watchers) -> None:
        """A generation ended (`text`: prompt + answer): `read` it, and remember its answer."""
        self.read(text[:-1], text[-1], *watchers)
        if self.memory is not None:
            self.memory.remember(text, self._n_prompt)

    def catch_up(self, committed: Sequence[int], root: int) -> list[int] | None:
        """Index committed + [root]; return the tokens emitted since the last root, or None when
        the text was replaced (a new prompt: what was being followed will never finish)."""
        live = self.index.live
        known, total = len(live), len(committed) + 1
        if 0 < known <= total:
            start = max(0, known - _TAIL_CHECK)
            tail = list(committed[start:known]) if known <= len(committed) else list(committed[start:]) + [root]
            if tail == live[start:known].tolist():
                new = list(committed[known:]) + [root] if known <= len(committed) else []
                self.index.extend(new)
                return new if len(new) <= self.max_step else None
        self.index.sync(list(committed) + [root])
        return None

    def read(self, committed: Sequence[int], root: int, *watchers) -> None:
        """`catch_up`, then feed the emitted tokens to each watcher (a Hindsight or
        HindsightByKind), or, when the text was replaced, make it drop what it follows."""
        emitted = self.catch_up(committed, root)
        for watcher in watchers:
            if emitted is None:
                watcher.forget_open()
            else:
                watcher.feed(emitted)


class LookupDrafter(Drafter):
    """Proposes lookup trees; adapts their size to measured acceptance and target cost.

    Each kind of proposal (mid-copy or not, long n-gram match or short: HindsightByKind) gets the
    budget its own measurements say pays, none until they show one does: watching a proposal costs
    no target pass, so learning is free and a new session starts with plain steps.
    """

    def __init__(self, max_budget: int, index: LookupIndex | None = None, cost: TargetCost | None = None, adapt: bool = True,
                 memory: OutputMemory | None = None):
        self.text = SessionText(index, max_step=max_budget + 1, memory=memory)
        self.max_budget = max_budget
        self.adapt = adapt
        self.seen = HindsightByKind(max_budget)
        self.cost = cost or TargetCost()
        self.step_s = Average(24)  # seconds of a step outside the target pass (lookup, walk, KV)
        self.chosen = 0  # the budget the last step chose
        self.idle = IdleSchedule()

    @property
    def index(self) -> LookupIndex:
        return self.text.index

    def start(self, n_prompt: int, max_tokens: int) -> None:
        self.text.start(n_prompt)

    def learn(self, text: Sequence[int], complete: bool = True) -> None:
        """Index a finished generation's text (prompt + answer), remember its answer, and finish
        watching its proposals."""
        self.text.learn(text, self.seen)

    def propose_after(self, committed: Sequence[int], root: int, forced: Sequence[int], budget: int,
                      depth: int) -> DraftTree | None:
        return self.text.propose_after(committed, root, forced, budget, depth)

    def propose_free(self, committed: Sequence[int], root: int, budget: int, depth: int) -> Proposal | None:
        return self.propose(committed, root, budget, depth)  # lookup runs no model pass

    def propose(self, committed: Sequence[int], root: int, budget: int, depth: int) -> Proposal | None:
        self.text.read(committed, root, self.seen)
        if not self.adapt:
            tree = self.text.propose(budget, depth)
            return lookup_proposal(tree) if tree is not None else None
        idle = self.chosen == 0 and not self.seen.run()
        if not self.idle.looks(idle, idle and self.text.strong()):
            return None
        tree = self.text.propose(budget, depth)
        kind = self.seen.kind(self.text.last_order, self.text.repeats(self.greedy))
        self.seen[kind].watch(tree)
        self.chosen = self.best_budget(self.seen.record(kind), budget, depth) if tree is not None else 0
        if self.chosen == 0:
            return None
        self.idle.paid()
        return lookup_proposal(cut(tree, self.chosen))

    def best_budget(self, hindsight: Hindsight, budget: int, depth: int | None = None) -> int:
        """The budget with the most tokens per second this kind of proposal has measured, for a
        tree at most `depth` deep."""
        overhead = float(self.step_s.mean) if self.step_s.known else 0.0
        return best_lookup_size(hindsight, self.cost, overhead, budget, self.beside, depth)

    def commit(self, proposal: Proposal, accepted_nodes: Sequence[int]) -> None:
        pass  # the next propose reads what was accepted from the committed text

    def observe(self, step) -> None:
        """Take one step's measurements (from the decoder)."""
        self.cost.observe(step.tree_nodes + 1, step.target_s)
        self.step_s.add(max(0.0, step.total_s - step.target_s))

    def observe_shared(self, n_tokens: int, seconds: float) -> None:
        self.cost.observe(n_tokens, seconds)

    def first_passes_apart(self) -> None:
        self.cost.set_first_passes_apart()

    def cost_step(self, step: int) -> None:
        self.cost.set_step(step)

    def reset(self) -> None:
        self.seen.forget_open()
