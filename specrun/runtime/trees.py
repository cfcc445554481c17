"""Which tree a run drafts, and why: flags, the stored tuning profile, or the default.

`choose_tree` decides the drafter and its tree from the options and the resolved model files
(explicit --budget/--depth > the stored tuning profile > the default chain; lookup alone,
MTP chains, or plain decoding where that is what the options or the profile say);
`fit_tree_to_target` turns it into what the target's architecture can verify exactly.
`runtime.plan` sizes contexts and memory for the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from specrun import architectures
from specrun.core.tree_shapes import TreeShape, template_shape
from specrun.decoding.adaptive import DraftPrior
from specrun.runtime.drafters import BEST_FIRST, LOOKUP, MTP, DraftModel, Drafting
from specrun.runtime.options import ModelFiles, RunOptions
from specrun.tuning import profiles
from specrun.tuning.cost_model import Choice

# Used when no tuning profile exists: a short chain (classic speculative decoding), which pays
# wherever the draft is much cheaper than the target, even on a CPU where wide trees cost dearly.
DEFAULT_SHAPE = TreeShape.chain(5)
# ... from which the draft model's tree grows online where this run's passes pay for more
# (decoding.drafters.growing), up to this many nodes: with the default lookup branches and the
# root, a target pass no wider than the prompt batch the context opens anyway (runtime.plan's
# PREFILL_BATCH), so growing costs no compute buffer of its own.
DEFAULT_GROWTH = 384
# The largest lookup tree a step may verify (the drafter adapts below it to what pays): deep
# enough for a long verbatim copy, wide enough for a few different continuations. 64 deep, not 32:
# a trusted repeat (an SQL sibling asked again) went in 3 passes of 63 nodes instead of 4 of 33,
# and a CPU's flash attention tiles passes of 64 tokens or more (the demo pair: repeated SQL
# 172-177 -> 177-186 tokens/s, code edits and rewrites 86-92 -> 91-95; chat and JSON level).
LOOKUP_SHAPE = TreeShape(budget=64, depth=64, width=1, top_k=1)
# The target's own MTP layers draft a chain per step, this long by default (llama.cpp's
# draft-mtp default; --depth or --budget sets it).
MTP_CHAIN = 3
# The longest chain a target with a recurrent state verifies per step: llama.cpp keeps one state
# snapshot per draft token (memory: the recurrent state times this), and chains gain little beyond.
MAX_CHAIN = 8
# Chains per step: each holds a recurrent state and its snapshots (memory: times this).
MAX_CHAINS = 4


@dataclass(frozen=True)
class TreePlan:
    """The tree a speculative run grows, which drafter proposes it, and why this one."""

    shape: TreeShape  # the draft model's tree (lookup alone: the largest lookup tree; MTP: its chain)
    drafting: Drafting  # which drafter proposes the trees (runtime.drafters)
    source: str  # "flags", "profile" or "default"
    lookup: TreeShape | None = None  # lookup nodes a step may add (None: no lookup)
    plain_s: float | None = None  # plain decoding's seconds per token by the tuning profile
    # How the target verifies: "tree" (attention KV cache) or "chains" (a recurrent state that
    # rolls back only in the sequence that made it: each step checks the proposal's best paths,
    # each in a sequence of its own).
    verify: str = architectures.TREE
    prior: DraftPrior | None = None  # the profile's figures for the draft model (hybrid's first steps)
    # The most nodes the draft model's tree may grow to online, from `shape` (None: it keeps `shape`).
    grow: int | None = None

    @property
    def drafter(self) -> str:
        """"draft model", "sequoia" (static, draft model), "lookup" (no model), "hybrid" or "mtp"."""
        return self.drafting.name(self)

    @property
    def kind(self) -> str:
        return self.drafting.kind(self)

    @property
    def verified(self) -> TreeShape:
        """The largest tree one target pass verifies: the draft model's plus lookup branches."""
        return self.drafting.verified(self)

    def describe(self) -> str:
        text = self.drafting.describe(self)
        if self.verify == architectures.CHAINS:
            text += f"; the target verifies up to {MAX_CHAINS} chains of up to {self.verified.depth} drafts per step"
        return text


def fit_tree_to_target(tree: TreePlan, why: str, arch: str) -> tuple[TreePlan | None, str, str | None]:
    """Return (the tree the target's architecture can verify exactly or None, why, a note or None).

    Attention targets verify trees as planned. Targets whose recurrent state rolls back verify
    chains: trees no deeper than MAX_CHAIN whose best paths (up to MAX_CHAINS) are scored each in
    a sequence of its own.
    Targets whose state cannot roll back decode plainly, said in one line.
    """
    support = architectures.speculation_support(arch)
    if support.shape == architectures.TREE:
        return tree, why, None
    if support.shape == architectures.PLAIN:
        return None, support.reason, f"plain decoding: {support.reason}"
    chained = tree.drafting.chained(tree, min(MAX_CHAIN, tree.verified.depth), MAX_CHAINS)
    return chained, f"{why}; {support.reason}", None


def fit_tree(tree: TreePlan, budget: int) -> TreePlan:
    """Return the tree cut to `budget` verified nodes (lookup branches give way first)."""
    return tree.drafting.cut(tree, budget)


def choose_tree(opts: RunOptions, files: ModelFiles,
                use_profile: bool = True) -> tuple[TreePlan | None, str, bool, float | None]:
    """Return (the tree or None for plain decoding, why, whether the pair is untuned, the
    target's one-token pass by the profile that decided, if one did and timed it).

    `--draft lookup`: lookup trees alone. Otherwise explicit --budget/--depth win; else the stored
    tuning profile; else the default chain. Lookup branches join the draft model's tree unless
    --no-lookup. A profile that measured the draft model's trees slower than plain decoding
    turns off the draft model only: lookup alone runs (plain decoding only with --no-lookup).
    With an explicit `--lookup` lookup also stands alone where there is no draft model. The
    profile's figures (`prior`) decide the hybrid's first steps in a fresh process.
    `use_profile=False`: as without a profile.
    """
    if opts.lookup_only:
        return _lookup_tree(opts, None), "--draft lookup: trees from the session's text, no draft model", False, None
    if files.mtp:
        return _mtp_tree(opts), files.mtp_why, False, None
    if files.draft_name is None:
        if opts.lookup is True:
            why = f"--lookup without a draft model for {files.target_name}: lookup alone"
            return _lookup_tree(opts, None), why, False, None
        why = "--no-spec" if opts.no_spec else f"no draft model for {files.target_name} (pass --draft)"
        return None, why, False, None
    choice = facts = None
    if use_profile and files.target_path is not None and files.draft_path is not None:
        profile = profiles.load(files.target_path, files.draft_path, **opts.profile_options())
        if profile is not None:  # (read once: its choice and its facts)
            choice = profiles.choice_of(profile)
            facts = profiles.facts_of(profile) if choice else None
    pass_s = facts.pass_s if facts is not None and 0 < (facts.pass_s or 0) < math.inf else None
    plain_s = None
    if choice is not None and choice.predicted_tokens_per_s > 0:
        plain_s = choice.predicted_speedup / choice.predicted_tokens_per_s  # tokens/s / speedup = plain's
    overridden = opts.budget is not None or opts.depth is not None
    if choice is not None and choice.kind == "plain" and not overridden:
        # The profile measured the draft model's trees slower than plain decoding here. That says
        # nothing about lookup, which costs no draft pass and sizes its trees online (plain steps
        # where it has nothing that pays): it stays on unless --no-lookup.
        why = "the tuning profile measured the draft model's trees slower than plain decoding here"
        if opts.lookup is False:
            return None, why + " (--no-lookup: plain decoding)", False, pass_s
        return _lookup_tree(opts, plain_s), why + ": lookup alone, sized online", False, pass_s
    tuned = tree_of_choice(choice) if choice is not None else None
    if tuned is not None:
        tree, why = tuned, "tuned profile for this pair on this machine"
    else:
        tree = TreePlan(DEFAULT_SHAPE, BEST_FIRST, "default", grow=DEFAULT_GROWTH)
        why = "default (no tuning profile: `specrun tune` measures one)"
    if overridden:
        shape = tree.shape
        if opts.budget is not None:
            shape = shape.resized(opts.budget)
        if opts.depth is not None:
            shape = replace(shape, depth=opts.depth)
        # explicit sizes: grow best-first trees of that size, of the tuned (or default) kind, always
        tree, why = TreePlan(shape, BEST_FIRST, "flags"), "--budget/--depth"
    tree = replace(tree, plain_s=plain_s, prior=facts.draft_prior(tree.shape) if facts is not None else None)
    if opts.lookup is True:
        tree, why = replace(tree, lookup=LOOKUP_SHAPE), why + "; --lookup adds branches from the session's text"
    elif opts.lookup is None:
        tree, why = replace(tree, lookup=LOOKUP_SHAPE), why + "; with lookup branches from the session's text (--no-lookup: without)"
    return tree, why, choice is None, pass_s


def _mtp_tree(opts: RunOptions) -> TreePlan:
    """Return the MTP chain: MTP_CHAIN drafts, or --depth (else --budget) of them."""
    depth = opts.depth or opts.budget
    shape = TreeShape.chain(depth or MTP_CHAIN)
    return TreePlan(shape, MTP, "flags" if depth else "default")


def _lookup_tree(opts: RunOptions, plain_s: float | None) -> TreePlan:
    """Return lookup trees alone: LOOKUP_SHAPE, or the --budget/--depth given."""
    shape, source = LOOKUP_SHAPE, "default"
    if opts.budget is not None or opts.depth is not None:
        shape, source = TreeShape(opts.budget or shape.budget, opts.depth or shape.depth, 1, 1), "flags"
    return TreePlan(shape, LOOKUP, source, lookup=shape, plain_s=plain_s)


def tuned_default(choice: Choice, facts: profiles.Facts | None) -> TreePlan:
    """The tree a run without flags grows from a profile: the profile's tree with lookup branches
    (the profile's figures deciding the hybrid's first steps), or lookup alone where the profile
    measured the draft model's trees slower than plain decoding."""
    tree = tree_of_choice(choice)
    if tree is None:
        return TreePlan(LOOKUP_SHAPE, LOOKUP, "profile", lookup=LOOKUP_SHAPE)
    return replace(tree, lookup=LOOKUP_SHAPE, prior=facts.draft_prior(tree.shape) if facts is not None else None)


def tree_of_choice(choice: Choice) -> TreePlan | None:
    """Return the tree a tuner choice stands for (None for plain decoding)."""
    if choice.kind == "plain":
        return None
    if choice.kind == "sequoia" and choice.tree is not None:
        return TreePlan(template_shape(choice.tree), DraftModel(choice.tree), "profile")
    return TreePlan(TreeShape(choice.budget, choice.depth, choice.width, choice.top_k), BEST_FIRST, "profile",
                    grow=choice.grow or None)
