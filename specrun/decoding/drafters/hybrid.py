"""`--lookup`: the draft model's tree with lookup branches grafted on, which cost no draft pass.

Each step the lookup index proposes a tree from the session's text (decoding/lookup_index.py). Its best nodes
are grafted onto the draft model's tree (as many as measured acceptance and the target's cost per
extra verified token say pay, decoding/adaptive.py). When the text clearly repeats -- lookup alone is
expected faster than draft tree + lookup, the draft model's catch-up with the text it has not read
counted -- the step leans on lookup and skips the draft model's passes, running it again every few
steps (when catching up is cheap) to keep measuring it.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from specrun.core.tree import MAX_LEAVES, DraftTree
from specrun.decoding.adaptive import (
    Average,
    DraftPrior,
    Hindsight,
    HindsightByKind,
    TargetCost,
)
from specrun.decoding.drafters.base import Drafter, ModelDrafter, Proposal
from specrun.decoding.drafters.best_first import READ_AHEAD
from specrun.decoding.drafters.lookup import IdleSchedule, SessionText, lookup_proposal
from specrun.decoding.pay.rules import (
    ALONE,
    DEFER_STEPS,
    LEAN_HALF_LIFE,
    LEAN_REFRESH,
    MIN_AHEAD,
    MIN_DRAFTED,
    REFRESH_DEBT,
    SHORT_DEBT,
    STEP_MARGIN,
    THIN_KIND,
    Beside,
    assumed_prior,
    best_lookup_size,
    draft_could_pay,
    faster,
)
from specrun.decoding.lookup_index import LookupIndex, cut, graft, new_by_rank
from specrun.decoding.memory import OutputMemory

_UNMEASURED = DraftPrior(plain_s=0.0, tree_s=0.0, step_s=0.0, catch_up_s=0.0, accepted=0.0)


class HybridDrafter(Drafter):
    """The draft model's tree plus lookup branches; leans on lookup while the text repeats.

    `draft` is a draft-model drafter (best_first.TreeGrower or a subclass): it says how far its
    cache is behind (`debt`) and what its last catch-up cost (`last_catch_up`).
    """

    reads_while_resting = True  # (extend: a step that leans, or a plain one, reads the text)

    def __init__(self, draft: ModelDrafter, draft_budget: int, lookup_budget: int, index: LookupIndex | None = None,
                 cost: TargetCost | None = None, adapt: bool = True, draft_depth: int | None = None,
                 prior: DraftPrior | None = None, catch_up_s: float | None = None,
                 best_case: DraftPrior | None = None, memory: OutputMemory | None = None):
        self.draft = draft
        # What the tuning profile measured for the draft model: decides the steps before this
        # process has run it (None: an assumed prior from what this process measured, see
        # _assumed_prior).
        self.prior = prior
        # Without a profile: the draft's catch-up seconds per token, measured when it was loaded
        # (TreeGrower.probe), which prices a long text's catch-up (see _assumed_prior).
        self.catch_up_s = catch_up_s
        # Without a profile: the draft's steps as timed when it was loaded, were every draft token
        # accepted. Where even that would not pay (pay.rules.draft_could_pay), the draft model never
        # runs in this process (exploring it costs a prompt's catch-up and a few losing steps:
        # the demo pair's free chat ran at 0.86x plain so on a host whose plain passes were fast).
        self.best_case = best_case
        self.draft_budget = draft_budget
        self.draft_depth = draft_depth  # the draft model's tree stays as deep as planned (None: any)
        self.lookup_budget = lookup_budget
        self.text = SessionText(index, max_step=draft_budget + lookup_budget + 1, memory=memory)
        self.adapt = adapt
        self.with_draft = Hindsight(lookup_budget)  # lookup nodes grafted onto the draft tree
        self.alone = HindsightByKind(lookup_budget)  # the lookup tree alone, per kind of match
        # The lookup tree alone on the steps that drafted (those with_draft watches): what leaning
        # would have made of them, which prices leaning while the kind's own record is thin.
        self.alone_on_drafts = Hindsight(lookup_budget)
        self.cost = cost or TargetCost()
        self.draft_s = Average(24)  # draft-model seconds of a step that runs it, catch-up aside
        # Seconds of one draft-model pass over n tokens: its catch-ups with unread text and its
        # expansion passes (one token a pass for a chain), which price a one-token catch-up.
        self.draft_pass = TargetCost()
        # Tokens a drafting step right after another one catches up with: the root, and the
        # chain's last token when the whole chain was accepted (never decoded by the draft).
        self.steady_debt = Average(24)
        # Seconds of a step outside the target's and the draft's passes, of steps that lean and
        # of steps that draft: a drafting step's bookkeeping (the draft's top-k rows, its
        # sequences) is several times a leaning step's, and pricing both alike made plain steps
        # look 20% dearer than they are on the demo pair (2.5 ms against 0.5 ms beside 10 ms
        # target passes), so that the hybrid drafted through chat at 0.82x plain. (Steps with
        # lookup branches alone share a plain step's figure: priced apart, marginal lookup
        # trees lost to plain steps, and code edits ran 3-5% slower.)
        self.overhead = {"lean": Average(24), "draft": Average(24)}
        self.drafted = False  # the last step ran the draft model
        self._deepest = 0  # the depth of the draft model's last tree
        self._lean_steps = 0
        self._free = False  # this step runs no draft pass (propose_free): it leans on lookup
        self._lean_proposal: Proposal | None = None
        self._reading: tuple[Sequence[int], int, int] | None = None  # (text, length, root) of the step proposed
        self.idle = IdleSchedule()  # when a leaning step looks at lookup's proposal
        self.answer_len = Average(8)  # tokens of this session's answers
        self._n_prompt, self._max_tokens = 0, 1 << 30  # the generation under way (see start)
        self._deferred = 0  # steps of this answer that waited before paying the draft's catch-up
        self._refreshed = False  # this answer has run the draft model again after leaning
        # Tokens and seconds of this answer's recent steps without the draft model.
        self._lean = Average(LEAN_HALF_LIFE, 2)

    @property
    def index(self) -> LookupIndex:
        return self.text.index

    def start(self, n_prompt: int, max_tokens: int) -> None:
        """A generation begins: a prompt of n_prompt tokens, at most max_tokens to generate."""
        self._n_prompt, self._max_tokens = n_prompt, max_tokens
        self.text.start(n_prompt)
        # The first drafting step of an answer catches up with its prompt: that is no steady
        # step's debt, whatever the last answer's last step was (counted as one, a 45-token chat
        # prompt priced every later drafting step at 420 ms where it took 60, and the demo pair's
        # chat leaned on plain steps at 0.92x plain over an RPC worker, where drafting ran 1.15x).
        self.drafted = False
        self._reading = None
        self._deferred = 0
        self._refreshed = False
        self._lean = Average(LEAN_HALF_LIFE, 2)

    def learn(self, text: Sequence[int], complete: bool = True) -> None:
        """Index a finished generation's text (prompt + answer) and finish watching its proposals.
        An answer the model ended (`complete`) tells how long answers run in this session; one cut
        by a token limit would have run longer, by how much nobody knows."""
        self.text.learn(text, self.with_draft, self.alone, self.alone_on_drafts)
        if complete:
            self.answer_len.add(len(text) - self._n_prompt)

    @property
    def drafts_beside_others(self) -> bool:
        return self.draft.drafts_beside_others

    def attach(self, lane) -> None:
        self.draft.attach(lane)

    def propose_after(self, committed: Sequence[int], root: int, forced: Sequence[int], budget: int,
                      depth: int) -> DraftTree | None:
        return self.text.propose_after(committed, root, forced, budget, depth)

    def propose_free(self, committed: Sequence[int], root: int, budget: int, depth: int) -> Proposal | None:
        """Lean on lookup this step (the draft model catches up when it drafts again)."""
        self._free = True
        try:
            return self.propose(committed, root, budget, depth)
        finally:
            self._free = False

    def propose(self, committed: Sequence[int], root: int, budget: int, depth: int) -> Proposal | None:
        self.text.read(committed, root, self.with_draft, self.alone, self.alone_on_drafts)
        self._reading = (committed, len(committed), root)
        lookup_budget = min(self.lookup_budget, budget)
        # While the draft model is not running and no lookup tree pays, look at lookup's
        # proposals exactly when lookup alone would (watching every chance match in free text,
        # this drafter trusted them sooner: a batch of Gemma rewrites ran at 0.81x lookup alone;
        # looking at a fresh process's first step too, which lookup alone leaves to its
        # schedule, it sized the demo pair's rewrites' trees otherwise, at 0.96x lookup alone).
        # A step that does not look proposes nothing unless it drafts: a plain step then costs
        # what lookup alone's does (a tree proposed each step made them 0.16 ms dearer, 2% of
        # the demo pair's plain passes).
        idle = not self.drafted and self._lean_proposal is None and not self.alone.run()
        look = self.idle.looks(idle, idle and self.text.strong())
        branches = self.text.propose(lookup_budget, depth) if lookup_budget and look else None
        kind = self.alone.kind(self.text.last_order, self.text.repeats(self.greedy)) if look else self.alone.kind(0)
        if look:
            self.alone[kind].watch(branches)
        proposed = look and branches is not None
        alone = self.alone.record(kind)
        if proposed:  # the record prices and sizes a lookup step only where lookup proposes one
            alone = self._lean_record(alone)
        self._lean_proposal = None
        leaning = self._free or self._should_lean(alone, proposed, self.alone.copying(kind), committed, root)
        after_draft, self.drafted = self.drafted, not leaning
        if leaning:
            self._lean_steps += 1
            chosen = self._best(alone, lookup_budget, self._overhead_s("lean"), depth) if proposed else 0
            if not chosen:
                return None  # a plain step beats the draft model's tree here
            self.idle.paid()
            self._lean_proposal = lookup_proposal(cut(branches, chosen))
            return self._lean_proposal
        self._lean_steps = 0
        if lookup_budget and not look:
            branches = self.text.propose(lookup_budget, depth)
        self.draft.beside = self.beside  # (a grown tree is sized by the pass it shares, as lookup's)
        grown = self.draft.propose(committed, root, min(self.draft_budget, budget), min(self.draft_depth or depth, depth))
        self._observe_draft(grown)
        if after_draft:
            self.steady_debt.add(self.draft.last_catch_up[0])
        tree = grown.tree
        base_len = len(tree)
        self._deepest = tree.max_depth
        room = budget - (base_len - 1)
        self.alone_on_drafts.watch(branches)
        if branches is None or room < 1:
            self.with_draft.watch(None, base=tree)
            return grown
        self.with_draft.watch(branches, base=tree, new_by_rank=new_by_rank(tree, branches))
        overhead = self._draft_step_s(self._steady_debt()) + self._overhead_s("draft")
        chosen = min(room, self._best(self.with_draft, lookup_budget, overhead, depth))
        if chosen:
            graft(tree, cut(branches, chosen), MAX_LEAVES)
            if len(tree) > base_len:
                grown.lookup_from = base_len
        return grown

    def _best(self, hindsight: Hindsight, budget: int, overhead: float, depth: int | None = None) -> int:
        """The lookup budget with the most tokens per second, a step costing `overhead` seconds
        beside the target's pass, its tree at most `depth` deep."""
        if not self.adapt or not hindsight.known:
            return budget
        return best_lookup_size(hindsight, self.cost, overhead, budget, self.beside, depth)

    def _lean_record(self, record: Hindsight) -> Hindsight:
        """The record that prices and sizes a lookup step alone: the kind's own (`record`), or,
        while it has watched fewer than THIN_KIND proposals, what lookup alone would have made
        of the steps that drafted where that is faster.

        A kind's record starts from DOUBT steps of nothing accepted, which fade with the steps
        it watches: a lookup step's few tokens at a time learn fast, but drafting steps that
        carry 20-30 tokens each (their lookup branches did) leave each kind two or three
        watches. Gemma-270M's chat answers, which repeat themselves, drafted so through copies
        that lookup alone ran 1.5x faster: a drafting step's lookup branches carried 25 tokens
        in 180 ms where lookup alone would have carried them in 80. A repeat's record
        (adaptive.REPEAT_MATCH) starts trusted: it is its own from the first step."""
        if record.watched >= THIN_KIND or record.trust or not self.alone_on_drafts.known:
            return record
        return self.alone_on_drafts if self._lean_rate(self.alone_on_drafts) > self._lean_rate(record) else record

    def _lean_rate(self, record: Hindsight, beside: Beside | None = None) -> float:
        """Tokens per second of lookup steps alone sized by `record` (a leaning step's overhead):
        beside other requests (`beside`, by default what the decoder said), of the pass they
        share (their tokens in it, and emitted from it)."""
        lean_s, beside = self._overhead_s("lean"), self.beside if beside is None else beside
        return record.best(lambda nodes: self.cost(nodes + 1 + beside.tokens) + lean_s, 0.0, beside.emitted)[1]

    def _overhead_s(self, kind: str) -> float:
        """Seconds of a step beyond its passes, a leaning or a drafting one (`kind`), as measured;
        before any was, a drafting step takes a leaning step's figure, and a leaning step none."""
        for known in (kind, "lean"):
            if self.overhead[known].known:
                return float(self.overhead[known].mean)
        return 0.0

    def _observe_draft(self, grown: Proposal) -> None:
        """Take what the draft model's passes cost this step.

        Every pass prices the draft's passes over that many tokens. Without its expansion passes
        a one-token catch-up (a step after a drafting step) would be priced from long catch-ups
        only (a prompt, what lean steps emitted), at a tenth of their per-pass cost per token:
        the demo pair's 49-token catch-up made it 19 ms where a pass takes 6, and the hybrid
        leaned on plain steps through a chat answer at 0.92x plain that the draft chain alone
        ran at 1.2x."""
        if self.draft.last_shared:
            return  # a pass that held other requests' trees too times theirs, not this one's
        caught, catch_up_s = self.draft.last_catch_up
        self.draft_pass.observe(caught, catch_up_s)
        for n_tokens, seconds in self.draft.last_passes:
            self.draft_pass.observe(n_tokens, seconds)
        self.draft_s.add(max(0.0, grown.draft_s - catch_up_s))

    def _steady_debt(self) -> float:
        """Tokens a drafting step usually catches up with, as measured (1 before it was: the root).
        A chain accepted whole leaves its last token to catch up with as well: on the demo pair's
        chat, priced as one token, drafting looked 9% faster than it ran, and beat plain steps
        that were faster."""
        return float(self.steady_debt.mean) if self.steady_debt.known else 1.0

    def _draft_step_s(self, debt: float) -> float:
        """Seconds the draft model would spend on a step: its catch-up over `debt` tokens (the
        root included) and its expansion passes."""
        catch_up = float(self.draft_pass(np.array([debt]))[0]) if self.draft_pass.known else 0.0
        return catch_up + (float(self.draft_s.mean) if self.draft_s.known else 0.0)

    def _should_lean(self, alone: Hindsight, proposed: bool, copying: bool, committed: Sequence[int], root: int) -> bool:
        """Whether to skip the draft model this step: lookup alone (or a plain step, when lookup
        proposes nothing or nothing that pays) is expected faster than the draft tree with lookup.

        The draft model may first have to catch up with text it has not read (a whole prompt, or
        what was copied since it last ran). That pays off over the rest of the answer: its cost
        is spread over the tokens this answer is expected to still have (answers so far in this
        session, at most what max_tokens leaves). While the text repeats, lookup carries on and
        the draft model is brought up only when it pays. After LEAN_REFRESH leaning steps it runs
        once to be measured again, except while the text is `copying` (a long run, or a greedy
        repeat: HindsightByKind.copying): a regenerated answer after an answer that leaned had
        its first step drafted 4 tokens deep where lookup proposed the whole 16.

        Beside other requests (`beside`) both are rates of the pass they share: its seconds with
        the others' tokens in it, and the tokens every request emits from it. A drafting step's
        nodes and its draft passes slow the others' tokens too, so a draft that pays alone may not
        beside others (pay.rules.best_size weighs lookup trees the same way).
        """
        if not self.adapt or (proposed and not alone.known):
            return False
        if not self.with_draft.known:
            return self._lean_by_prior(alone, proposed, committed, root)
        debt = self.draft.debt(committed, root)
        if not proposed and self.with_draft.watched < MIN_DRAFTED:
            return False
        beside = self.beside
        if proposed:
            lean = self._lean_rate(alone)
        else:
            lean = (1.0 + beside.emitted) / (float(self.cost(np.array([1.0 + beside.tokens]))[0]) + self._overhead_s("lean"))
        ahead = self._tokens_ahead(len(committed) + 1, debt)
        draft_s = self._draft_step_s(self._steady_debt())
        catch_up_s = max(0.0, self._draft_step_s(debt) - draft_s)  # beyond a drafting step's usual catch-up
        accepted, nodes = self.with_draft.accepted() + 1.0, self.with_draft.nodes()
        seconds = self.cost(nodes + 1 + beside.tokens) + self._overhead_s("draft") + draft_s + catch_up_s * accepted / ahead
        if self._lean_steps >= LEAN_REFRESH and not copying and debt <= REFRESH_DEBT:
            # The draft's own tree accepted whole: its deepest path, the catch-up spread as ever.
            tokens = self._deepest + 1.0
            whole = (tokens + beside.emitted) / (float(seconds[0]) + catch_up_s * (tokens - float(accepted[0])) / ahead)
            if faster(whole, lean, 0.0 if not self._refreshed else STEP_MARGIN):
                self._refreshed = True
                return False
        return lean > float(np.max((accepted + beside.emitted) / seconds))

    def _lean_by_prior(self, alone: Hindsight, proposed: bool, committed: Sequence[int], root: int) -> bool:
        """Before this process has run the draft model, decide from the profile's figures (or,
        without a profile, from what _assumed_prior makes of this process's measurements).

        A catch-up with the text so far (a whole prompt, in a fresh process) that costs more than
        drafting would save over DEFER_STEPS steps waits: while the answer follows lookup's
        proposals (a copy) and for DEFER_STEPS steps after, plain or lookup steps, lookup
        learning for free whether the answer copies the text. Then (or at once, when the
        catch-up is cheap: a short prompt) the draft model runs unless lookup alone, or a plain
        step, is expected faster than its steps with that catch-up spread over the answer.
        """
        if self.prior is None and not self.could_pay():
            return True
        debt = self.draft.debt(committed, root)
        prior = self.prior or self._assumed_prior(debt)
        if prior is None:
            # Nothing to price the draft by: it runs, except on a greedy repeat, whose lookup
            # proposal is the target's own earlier text (its record: adaptive.REPEAT_TRUST).
            return proposed and alone.trust > 0
        if prior is _UNMEASURED:
            # Nothing measured yet (the answer's first step) and a long text to catch up with:
            # one plain or lookup step first, which measures the target and what lookup finds.
            self._deferred += 1
            return True
        measured = self.cost.plain_s() if self.cost.known else None
        scale = measured / prior.plain_s if measured and prior.plain_s > 0 else 1.0
        plain_rate = 1.0 / (prior.plain_s * scale)
        ahead = self._tokens_ahead(len(committed) + 1, debt)
        saved = (prior.accepted + 1.0) * max(0.0, 1.0 / plain_rate - 1.0 / prior.draft_rate(1, ahead, scale))
        if debt > SHORT_DEBT and max(0, debt - 1) * prior.catch_up_s * scale > DEFER_STEPS * saved:
            if self.alone.run(2):
                self._deferred = 0  # the answer is copying the text: lookup carries it
                return True
            if self._deferred < DEFER_STEPS:
                self._deferred += 1
                return True
        lean = plain_rate
        if proposed and self.cost.known:
            lean = max(lean, self._lean_rate(alone, ALONE))  # (the profile's draft rate is one request's)
        if self._lean.known:
            # What leaning has made of this answer's recent steps, plain and lookup steps
            # together: the rest of an answer that copied is expected to go on much as it went
            # (a step that looks at no proposal says nothing of that: Gemma's rewrites paid a
            # 0.7 s catch-up where a copy broke off, at 0.93x of leaning on).
            tokens, seconds = self._lean.mean
            lean = max(lean, tokens / seconds)
        return lean > prior.draft_rate(debt, ahead, scale)

    def best_speedup(self) -> float | None:
        """The draft's tree accepted whole, against plain steps, as timed when it was made (None
        when nothing was timed: a profile's figures decide)."""
        best = self.best_case
        return best.draft_rate(1, 1.0) * best.plain_s if best is not None else None

    def could_pay(self) -> bool:
        """Whether the draft's tree, accepted whole, would pay as timed when it was made
        (pay.rules.draft_could_pay; True when nothing was timed)."""
        return draft_could_pay(self.best_speedup())

    def _assumed_prior(self, debt: int) -> DraftPrior | None:
        """Without a profile: a prior from this process's own measurements (the draft's catch-up
        cost, the target's passes) and a modest assumption of the draft's gain (pay.rules.assumed_prior),
        so that a fresh process does not pay a long text's catch-up before lookup has seen
        whether the answer copies it. None where nothing is put off (the catch-up cost unknown,
        or a short catch-up); _UNMEASURED before any target pass of this process was measured."""
        if self.catch_up_s is None or debt <= SHORT_DEBT:
            return None
        if not self.cost.known:
            return _UNMEASURED
        return assumed_prior(float(self.cost(np.array([1]))[0]), self.catch_up_s)

    def _tokens_ahead(self, n_text: int, debt: int) -> float:
        """Tokens this answer is expected to still generate (at least 1), to spread a catch-up
        with `debt` unread tokens over.

        Before any answer of this session has ended, and for a long catch-up (over SHORT_DEBT
        tokens), an answer that has run g tokens is expected to run about g more (at least
        MIN_AHEAD), not up to max_tokens: the catch-up is then paid once the draft's gain
        forgone so far would have paid for it (renting until the rent paid equals the price of
        buying: at worst twice what knowing the answer's length would have cost, and never
        slower than plain decoding). Expecting max_tokens paid a 0.8 s catch-up for a 41-token
        quote that the demo pair then answered at 0.81x plain. A short catch-up never waits: it
        is spread over all that max_tokens leaves."""
        generated = max(0, n_text - self._n_prompt)
        left = max(1, self._max_tokens - generated)
        if not self.answer_len.known:
            return float(min(left, max(MIN_AHEAD, generated))) if debt > SHORT_DEBT else float(left)
        return float(min(left, max(MIN_AHEAD, float(self.answer_len.mean) - generated)))

    def overlaps(self) -> None:
        self.draft.overlaps()

    def first_passes_apart(self) -> None:
        self.cost.set_first_passes_apart()
        self.draft.first_passes_apart()

    def cost_step(self, step: int) -> None:
        self.cost.set_step(step)
        self.draft.cost_step(step)

    def prepare(self, text: Sequence[int], done) -> None:
        if self.could_pay():  # (a draft that never runs in this process reads nothing)
            self.draft.prepare(text, done)

    def extend(self, done) -> None:
        """While the target's pass runs elsewhere: the draft model grows the tree it proposed on;
        on a step that leans on lookup (or a plain one), it reads the text it has not read and
        the lookup tree's best path, so that drafting again later costs no long catch-up, in
        passes that end within the target's as far as both are measured (a pass that outlasts
        it holds the step up)."""
        if self.drafted:
            self.draft.extend(done)
            return
        if self._reading is None or not self.could_pay():
            return
        committed, n, root = self._reading
        ahead: list[int] = []
        n_pass = 1
        if self._lean_proposal is not None:
            tree = self._lean_proposal.tree
            ahead = tree.tokens[tree.best_path()[1:]].tolist()
            n_pass = len(tree)
        fits = None
        if self.cost.known and self.draft_pass.known:
            ends = time.perf_counter() + float(self.cost(np.array([n_pass]))[0])
            sizes = np.arange(1, READ_AHEAD + 1)
            draft_s = self.draft_pass(sizes)

            def fits() -> int:
                left = ends - time.perf_counter()
                ok = np.flatnonzero(draft_s <= left)
                return int(ok[-1]) + 1 if len(ok) else 0
        self.draft.read_ahead([*committed[:n], root, *ahead], done, fits)
        for tokens, seconds in self.draft.last_read:
            self.draft_pass.observe(tokens, seconds)

    def commit(self, proposal: Proposal, accepted_nodes: Sequence[int]) -> None:
        if proposal is not self._lean_proposal:
            self.draft.commit(proposal, accepted_nodes)  # grafted nodes are not in the draft's cache

    def observe(self, step) -> None:
        """Take one step's measurements (from the decoder)."""
        self.cost.observe(step.tree_nodes + 1, step.target_s)
        self.draft.observe(step)  # (a draft model's tree grown online sizes itself by it)
        drafted = step.draft_passes or step.reused_nodes  # (reused: drafted during the pass before)
        self.overhead["draft" if drafted else "lean"].add(max(0.0, step.total_s - step.target_s - step.draft_s))
        if not self.drafted:
            self._lean.add([len(step.tokens), step.total_s])

    def observe_shared(self, n_tokens: int, seconds: float) -> None:
        self.cost.observe(n_tokens, seconds)  # (its draft model's, where it feeds its own: the same curve)

    def reset(self) -> None:
        self.draft.reset()
        self.drafted = False
        self._reading = None
        self.with_draft.forget_open()
        self.alone.forget_open()
        self.alone_on_drafts.forget_open()
