"""Which drafter proposes a speculative run's trees: one object the tree plan holds.

Three kinds: a draft model (growing best-first trees, or a tuned Sequoia template; with lookup
branches grafted on it is the hybrid), lookup alone (trees from the session's text, no model),
and the target's own MTP layers. Each says what a run loads for it, what one target pass
verifies, how `specrun plan` names and describes it, how it fits a target that verifies chains
or a smaller batch, and builds the decoding drafter (decoding/drafters/) for a loaded run.
runtime.trees decides which kind a run uses; nothing else asks which kind it holds.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import ClassVar

from specrun import architectures
from specrun.core.tree_shapes import MAX_BUDGET, TreeShape, TreeTemplate, grown_shape
from specrun.decoding.adaptive import DraftPrior, TargetCost
from specrun.decoding.drafters.base import Drafter
from specrun.decoding.drafters.best_first import TreeGrower
from specrun.decoding.drafters.growing import GrowingTrees
from specrun.decoding.drafters.hybrid import HybridDrafter
from specrun.decoding.drafters.lookup import LookupDrafter
from specrun.decoding.drafters.mtp import MtpDrafter
from specrun.decoding.drafters.sequoia import StaticTreeGrower
from specrun.decoding.kv import probe_context
from specrun.tuning import profiles
from specrun.tuning.cost_model import CostCurve

log = logging.getLogger("specrun")


class Drafting(ABC):
    """A kind of drafter, as a plan holds it (frozen: plans compare equal by value). Its methods
    take the runtime.trees.TreePlan that holds it (`tree`: shapes, lookup branches, source),
    and those that change it return another."""

    loads_draft_model: ClassVar[bool] = False  # the run loads the draft model for it
    loads_mtp: ClassVar[bool] = False  # the run loads the target's MTP layers and an MTP context

    @abstractmethod
    def name(self, tree) -> str:
        """What `specrun plan` calls the drafter: "draft model", "sequoia", "hybrid", "lookup" or "mtp"."""

    @abstractmethod
    def kind(self, tree) -> str:
        """The tree's kind in `plan --json`: "chain", "specexec", "sequoia", "lookup" or "mtp"."""

    @abstractmethod
    def describe(self, tree) -> str:
        """One line: what each step drafts."""

    @abstractmethod
    def headline(self, tree, draft_name: str | None) -> str:
        """How `chat` and `serve` say it when they start: "with draft X (tree budget 5) and lookup"."""

    def verified(self, tree) -> TreeShape:
        """The largest tree one target pass verifies."""
        return tree.shape

    @abstractmethod
    def chained(self, tree, depth: int, n_chains: int):
        """The tree for a target whose recurrent state rolls back only in the sequence that made
        it: up to `n_chains` chains of at most `depth` drafts a step."""

    @abstractmethod
    def cut(self, tree, budget: int):
        """The tree cut to `budget` verified nodes."""

    def with_lookup(self, tree, lookup: TreeShape):
        """The tree with lookup branches of at most `lookup`."""
        return replace(tree, lookup=lookup)

    def for_recurrent_draft(self, tree):
        """The tree where the draft model has a recurrent state (one sequence per tree node)."""
        return tree

    @abstractmethod
    def build(self, tree, draft=None, draft_ctx=None, target_ctx=None, draft_lane=None, memory=None, timed=None) -> Drafter:
        """The drafter of a loaded run: `draft` and `draft_ctx` are the draft model and its context
        (the MTP context for MTP chains), `target_ctx` the target's; `draft_lane` the request's
        share of a draft context several requests draft in (decoding.batching), else all of it;
        `memory` the answers of the process's other requests (decoding.memory), which lookup reads;
        `timed` the target's passes timed at start-up ({tokens: seconds}), shared by the decoders of
        one start (each lane's would time them again: 200 ms from an RPC worker a probe of five
        passes took 2.2 s, four lanes 9 s before the first answer)."""


@dataclass(frozen=True)
class DraftModel(Drafting):
    """The draft model grows a tree each step: best-first (SpecExec) to the plan's shape, or the
    tuned Sequoia `template` as is; with lookup branches grafted on, the hybrid."""

    template: TreeTemplate | None = None
    loads_draft_model: ClassVar[bool] = True

    def name(self, tree) -> str:
        if tree.lookup is not None:
            return "hybrid"
        return "sequoia" if self.template is not None else "draft model"

    def kind(self, tree) -> str:
        if self.template is not None:
            return "sequoia"
        return "chain" if tree.shape.is_chain else "specexec"

    def describe(self, tree) -> str:
        s = tree.shape
        if self.template is not None:
            text = f"Sequoia static tree of {s.budget} draft tokens, depth {s.depth}"
        elif s.is_chain:
            text = f"chain of {s.budget} draft tokens"
        else:
            text = f"best-first tree of {s.budget} draft tokens, depth {s.depth}, width {s.width}, top-k {s.top_k}"
        if tree.grow is not None:
            text += f", growing to up to {tree.grow} where this run's passes pay for more"
        if tree.lookup is not None:
            text += f" + up to {tree.lookup.budget} lookup tokens from the session's text"
        return text

    def headline(self, tree, draft_name: str | None) -> str:
        text = f"with draft {draft_name} (tree budget {tree.shape.budget})"
        return text + " and lookup" if tree.lookup is not None else text

    def verified(self, tree) -> TreeShape:
        shape = tree.shape
        if tree.grow is not None:
            grown = grown_shape(tree.grow)
            shape = replace(shape, budget=max(shape.budget, grown.budget), depth=max(shape.depth, grown.depth))
        if tree.lookup is None:
            return shape
        return replace(shape, budget=min(MAX_BUDGET, shape.budget + tree.lookup.budget),
                       depth=max(shape.depth, tree.lookup.depth))

    def chained(self, tree, depth: int, n_chains: int):
        s = tree.shape
        shape = TreeShape(min(s.budget, n_chains * depth), min(s.depth, depth), s.width, s.top_k)
        lookup = TreeShape(n_chains * depth, depth, 1, 1) if tree.lookup is not None else None
        return replace(tree, shape=shape, drafting=DraftModel(), lookup=lookup, verify=architectures.CHAINS, grow=None)

    def cut(self, tree, budget: int):
        # Growth gives way first, then lookup branches.
        if tree.grow is not None:
            room = budget - (tree.lookup.budget if tree.lookup is not None else 0)
            if room > tree.shape.budget:
                return replace(tree, grow=min(room, tree.grow))
            tree = replace(tree, grow=None)
        if tree.lookup is not None and tree.shape.budget < budget:
            return replace(tree, lookup=tree.lookup.resized(budget - tree.shape.budget))
        return replace(tree, shape=tree.shape.resized(budget), drafting=DraftModel(), lookup=None)

    def for_recurrent_draft(self, tree):
        # Such a draft's context keeps few sequences (one per node of the planned tree): the
        # template's size as best-first trees, and no growing.
        return replace(tree, drafting=DraftModel(), grow=None)

    def build(self, tree, draft=None, draft_ctx=None, target_ctx=None, draft_lane=None, memory=None, timed=None) -> Drafter:
        # The target's passes as the hybrid measures them, which a tree grown online sizes itself by.
        cost = TargetCost() if tree.lookup is not None else None
        if self.template is not None:
            model_drafter = StaticTreeGrower(draft, draft_ctx, self.template, draft_lane)
        elif tree.grow is not None:
            grower = TreeGrower(draft, draft_ctx, grown_shape(tree.grow), draft_lane)  # (its batch for the widest)
            grower.shape = tree.shape
            model_drafter = GrowingTrees(grower, tree.shape, tree.grow, cost=cost)
        else:
            model_drafter = TreeGrower(draft, draft_ctx, tree.shape, draft_lane)
        if tree.lookup is None:
            return model_drafter
        # Without a profile's figures the draft's passes are timed now (short passes, a warm-up
        # too): its catch-up cost decides whether a long prompt's catch-up waits while lookup
        # looks; for the default tree (not one asked for with --budget or --depth), with the
        # target's passes timed too, they say whether the draft's tree could pay at all.
        draft_passes = model_drafter.probe() if tree.prior is None else None
        catch_up_s = best_case = None
        if draft_passes is not None:
            widest = max(draft_passes)
            catch_up_s = draft_passes[widest] / widest
            if tree.source == "default":
                best_case = _best_case(tree.shape, draft_passes, target_ctx, cost, timed)
        grown = grown_shape(tree.grow) if tree.grow is not None else tree.shape
        hybrid = HybridDrafter(model_drafter, grown.budget, tree.lookup.budget, draft_depth=max(tree.shape.depth, grown.depth), cost=cost,
                               prior=tree.prior, catch_up_s=catch_up_s, best_case=best_case, memory=memory)
        if not hybrid.could_pay():
            log.info("the draft model stays off: its tree would run at %.2fx plain decoding at best (every draft "
                     "token accepted, passes timed now); lookup and plain steps decode. `specrun tune` measures "
                     "this machine", hybrid.best_speedup())
        return hybrid


@dataclass(frozen=True)
class Lookup(Drafting):
    """Lookup alone: trees from continuations of earlier occurrences in the session's text, no
    model (the plan's shape is the largest lookup tree, and its lookup too)."""

    def name(self, tree) -> str:
        return "lookup"

    def kind(self, tree) -> str:
        return "lookup"

    def describe(self, tree) -> str:
        s = tree.shape
        return f"lookup trees of up to {s.budget} tokens from the session's text, depth {s.depth} (no draft model)"

    def headline(self, tree, draft_name: str | None) -> str:
        return f"with lookup drafting (tree budget {tree.shape.budget})"

    def chained(self, tree, depth: int, n_chains: int):
        lookup = TreeShape(n_chains * depth, depth, 1, 1)
        return replace(tree, shape=lookup, lookup=lookup, verify=architectures.CHAINS)

    def cut(self, tree, budget: int):
        shape = tree.shape.resized(budget)
        return replace(tree, shape=shape, lookup=shape)

    def with_lookup(self, tree, lookup: TreeShape):
        return replace(tree, shape=lookup, lookup=lookup)

    def build(self, tree, draft=None, draft_ctx=None, target_ctx=None, draft_lane=None, memory=None, timed=None) -> Drafter:
        return LookupDrafter(tree.shape.budget, memory=memory)


@dataclass(frozen=True)
class Mtp(Drafting):
    """The target's own MTP layers draft a chain of `shape.depth` each step, in an MTP context of
    their own fed the target's hidden rows (no draft model)."""

    loads_mtp: ClassVar[bool] = True

    def name(self, tree) -> str:
        return "mtp"

    def kind(self, tree) -> str:
        return "mtp"

    def describe(self, tree) -> str:
        return f"chain of {tree.shape.depth} drafts from the target's own MTP layers (no draft model)"

    def headline(self, tree, draft_name: str | None) -> str:
        return f"with its own MTP layers drafting (chains of {tree.shape.depth})"

    def chained(self, tree, depth: int, n_chains: int):
        # One chain: the MTP layers draft one path.
        return replace(tree, shape=TreeShape.chain(depth), verify=architectures.CHAIN)

    def cut(self, tree, budget: int):
        return replace(tree, shape=tree.shape.resized(budget), lookup=None)

    def build(self, tree, draft=None, draft_ctx=None, target_ctx=None, draft_lane=None, memory=None, timed=None) -> Drafter:
        drafter = MtpDrafter(draft_lane if draft_lane is not None else draft_ctx, tree.shape.depth)
        drafter.reset()  # a new drafter: its sequence starts empty
        return drafter


BEST_FIRST = DraftModel()
LOOKUP = Lookup()
MTP = Mtp()


def _best_case(shape: TreeShape, draft_passes: dict[int, float], target_ctx, cost: TargetCost,
               timed: dict[int, float] | None = None) -> DraftPrior | None:
    """What the draft model's steps would be, timed now, if the target accepted every draft token:
    a profile's prior for the tree (profiles.Facts.draft_prior) from the target's passes over one
    token and over the tree and the draft's `draft_passes` ({tokens: seconds}), with the catch-up
    of the tree's last token, which the draft never decoded. None when the target's passes cannot
    be timed (no context, or one that cannot be probed).

    The target's passes timed here are also the first points of `cost`, the drafter's curve of
    them: its steps verify trees, so without them it would know a one-token pass only as a tree
    pass taken back at a prior cost per token (on a fast host the demo target's 9.8 ms pass looked
    like 15 ms there, and a fresh process's first answer drafted through at 0.65x plain). `timed`:
    the passes timed by another decoder of the same start, taken from there and added to."""
    if target_ctx is None:
        return None
    sizes = (1, shape.budget + 1)
    seconds = {n: timed[n] for n in sizes if n in timed} if timed is not None else {}
    if len(seconds) < len(sizes):
        # The least of two timings each: the target's passes are short, and their ratio decides.
        seconds = probe_context(target_ctx, sizes, repeats=2, logits="all")
        if not seconds:
            return None
        if timed is not None:
            timed.update(seconds)
    for n_tokens, pass_s in seconds.items():
        cost.observe(n_tokens, pass_s)
    facts = profiles.Facts(target=CostCurve.from_points(seconds), draft=CostCurve.from_points(draft_passes),
                           plain_s=seconds[1], tau={shape.budget: shape.depth + 1.0}, tree_speedup=None)
    prior = facts.draft_prior(shape)
    return replace(prior, step_s=prior.step_s + prior.catch_up_s)
