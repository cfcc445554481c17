"""What `specrun tune` checks last: the default a run of this pair will use, per workload.

For each of bench's workloads (free chat, code edits, rewrites) the default that the new profile
makes (the tuned tree with lookup branches, or lookup alone) and plain decoding decode the same
prompts, greedily, the order alternating prompt by prompt (plain decoding a quarter as many tokens:
PLAIN_SHARE). Every prompt gets a fresh drafter, as a fresh process would (no session text, nothing
measured yet: the profile's figures decide the first steps). The even rounds of a workload's
requests (one request of each kind a round) predict its speedup; the odd rounds, held out, measure
it (workloads.KINDS, ROUNDS). The two halves take turns prompt by prompt
(experiments.runner.decode_halves), so a machine whose speed moves during the minutes a tune takes
moves both alike.

On the predicting half the untuned default (what runs without a profile: a chain of DEFAULT_SHAPE
with lookup branches) decodes too, in turn with the others: where the tuned tree's default runs a
workload slower than it by more than pay's UNTUNED_MARGIN, or the workloads slower on the whole, the
untuned chain is what is stored, so that a profile never makes a workload slower than no profile.
Both decode the held-out half too (the choice is not known until the predicting half is done, and
the halves take turns); only the predicting half decides, and the held-out figure reported is that
of what was stored. The tree check (tune._check) compares the trees alone; with lookup branches on,
a deep tree can lose where its draft passes pay for tokens that lookup would have carried for free
(the Gemma pair's chat after a full tune: a Sequoia tree of 15 at 0.81x of the untuned chain on
chat, though 17% faster than it alone).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from specrun import ui
from specrun.decoding.pay.rules import UNTUNED_MARGIN, lost_to
from specrun.experiments.runner import Modes, Run, by_mode, decode_halves
from specrun.experiments.workloads import KINDS, ROUNDS, WORKLOADS
from specrun.runtime.trees import tuned_default
from specrun.tuning.cost_model import Choice

# Two-sided 95% of a normal distribution, for the range a prediction expects (_Half.expected_range).
_Z95 = 1.96
# Plain decoding's tokens a prompt, as a share of the default's (at least PLAIN_TOKENS): plain
# decoding moves at one speed whatever the prompt (a one-token pass each), where the default's
# differs several times from one prompt to the next (a code edit copied 30 tokens a pass, the
# next answer written anew). The time its shorter runs save measures more prompts, which is what
# a workload's prediction for others needs (_Half.expected_range): over a network plain decoding
# took most of a pair's time (at 200 ms a 64-token answer 27 s, the default's 3-5 s).
PLAIN_SHARE = 0.25
PLAIN_TOKENS = 16
# Pairs of prompts (one predicting, one held out) each workload measures whatever its time: one
# pair a workload is no prediction at all (a 200 ms network left tune's quick form that many).
MIN_PAIRS = 3


def measure_default(rt, choice, facts, n_prompts: int, max_tokens: int, progress,
                   untuned: Choice | None = None, seconds: float | None = None) -> tuple[Choice, dict]:
    """Return (the choice kept, {workload: {"drafter", "predicted_speedup", "measured_speedup", ...}})
    and print a line each. `untuned`: the untuned default's tuner choice (None: `choice` is it).
    `seconds`: the time all workloads may take (None: every prompt); each workload gets an equal
    share of what is left when it starts, and past it no further pair of prompts starts but the
    first MIN_PAIRS, so on a slow machine each workload is measured on fewer prompts (its expected
    range widens)."""
    candidates = {"tuned": _fitted(rt, tuned_default(choice, facts))}
    if untuned is not None:
        candidates["untuned"] = _fitted(rt, tuned_default(untuned, facts))
    per_half = _half_rounds(n_prompts)
    prompts = {name: [[rt.tokenize_prompt(texts[i], chat=True) for i in indexes] for indexes in per_half]
               for name, texts in WORKLOADS.items()}
    runs_a_pair = 2 * (1 + len(candidates))  # a prompt of each half, plainly and by every candidate
    task = progress.add_task("the default, per workload", total=len(WORKLOADS) * len(per_half[0]) * runs_a_pair)
    advance = lambda: progress.advance(task)
    predicting, held_out = {}, {}
    end = time.monotonic() + seconds if seconds is not None else None
    for left, (name, halves) in zip(range(len(prompts), 0, -1), prompts.items()):
        now = time.monotonic()
        deadline = None if end is None else now + max(0.0, end - now) / left
        predicting[name], held_out[name] = _decode_halves(rt, candidates, halves, max_tokens, advance, deadline)
    ran = {name: len(halves["tuned"].plain) for name, halves in predicting.items()}  # prompts of each half
    progress.update(task, total=sum(ran.values()) * runs_a_pair)  # done, where the time ran out
    short = {name: n for name, n in ran.items() if n < len(per_half[0])}
    if short:
        ui.dim("the time for the default per workload ran out: " + ", ".join(
            f"{name} on {2 * n} of {2 * len(per_half[0])} prompts" for name, n in short.items()))
    kept, slower = "tuned", _slower_workloads(predicting)
    if slower:
        kept = "untuned"
        said = ", ".join(f"{name} (x{tuned:.2f} against x{other:.2f})" for name, (tuned, other) in slower.items())
        ui.dim(f"with lookup branches the tuned tree ran slower than the untuned default on {said}: storing the untuned default")
    tree = candidates[kept]
    out = {}
    for name in prompts:
        predicted, measured = predicting[name][kept], held_out[name][kept]
        expected = predicted.expected_range()
        out[name] = {
            "drafter": tree.drafter,
            "predicted_speedup": round(predicted.speedup, 3),
            "measured_speedup": round(measured.speedup, 3),
            # Where the held-out half's figure is expected, from how unlike the predicting
            # half's prompts were (_Half.expected_range).
            "predicted_range": [round(bound, 3) for bound in expected],
            # The held-out prompts' own spread: a prediction for a workload can be no closer
            # than its prompts are alike.
            "measured_range": [round(min(measured.each), 3), round(max(measured.each), 3)],
            "lookup_tokens": measured.lookup_tokens,
            "prompts": len(predicted.plain) + len(measured.plain),
            "tokens": max_tokens,
        }
        if "untuned" in candidates:
            out[name]["tuned_drafter"] = candidates["tuned"].drafter  # lookup: the tune chose no draft tree
            for which in candidates:  # both, on each half: the predicting half decided
                out[name][f"{which}_speedup"] = round(predicting[name][which].speedup, 3)
                out[name][f"{which}_measured_speedup"] = round(held_out[name][which].speedup, 3)
            out[name]["tuned_slower"] = name in slower
        ui.dim(f"{name}: the default ({tree.drafter}) predicted x{predicted.speedup:.2f} on {len(predicted.plain)} prompts "
               f"(x{expected[0]:.2f} to x{expected[1]:.2f} for as many others), measured x{measured.speedup:.2f} "
               f"on {len(measured.plain)} others of the same kinds "
               f"(x{min(measured.each):.2f} to x{max(measured.each):.2f} each)")
    rt.clear_contexts()
    return (untuned if kept == "untuned" else choice), out


def _fitted(rt, tree):
    """The tree with its lookup branches cut to what one target batch holds beside the draft tree."""
    room = rt.target_ctx.n_batch - 1 - (tree.shape.budget if tree.drafting.loads_draft_model else 0)
    if tree.lookup is not None and tree.lookup.budget > room:
        tree = tree.drafting.with_lookup(tree, tree.lookup.resized(room))
    return tree


def _slower_workloads(predicting: dict[str, dict[str, _Half]]) -> dict[str, tuple[float, float]]:
    """{workload: (tuned speedup, untuned speedup)} where the untuned default is to be stored: the
    tuned default ran some workload slower than the untuned one by more than UNTUNED_MARGIN on the
    predicting half (those workloads), or ran slower on the whole, the workloads' ratios' geometric
    mean below 1 (every workload it lost: the Gemma pair's full tune stored a Sequoia tree of 15
    that ran each workload 1-4% slower than the chain on its predicting prompts). Nothing where
    only one ran."""
    ran = {name: (halves["tuned"].speedup, halves["untuned"].speedup)
           for name, halves in predicting.items() if "untuned" in halves}

    def lost(margin: float) -> dict[str, tuple[float, float]]:
        return {name: (tuned, untuned) for name, (tuned, untuned) in ran.items() if lost_to(tuned, untuned, margin)}

    slower = lost(UNTUNED_MARGIN)
    ratios = [tuned / untuned for tuned, untuned in ran.values() if tuned > 0 and untuned > 0]  # 0: unknown
    if ratios and not slower and sum(map(math.log, ratios)) < 0:
        slower = lost(0.0)
    return slower


def _half_rounds(n_prompts: int) -> tuple[list[int], list[int]]:
    """Return the indexes into a workload's prompts that predict and that measure: n_prompts in
    all, each half the same kinds, rounds alternating between the halves (0, 2, ...: predict; 1, 3,
    ...: measure). Fewer than two prompts a kind take the first kinds of rounds 0 and 1."""
    n_prompts = max(2, min(n_prompts, KINDS * ROUNDS))
    kinds = min(KINDS, n_prompts // 2)
    rounds = max(1, n_prompts // (2 * kinds))
    return tuple([r * KINDS + i for r in range(first, 2 * rounds, 2) for i in range(kinds)] for first in (0, 1))


@dataclass
class _Half:
    """Plain decoding and the default on some prompts: tokens and seconds of each, per prompt."""

    plain: list[tuple[int, float]] = field(default_factory=list)
    default: list[tuple[int, float]] = field(default_factory=list)
    lookup_tokens: int = 0

    @property
    def speedup(self) -> float:
        """The default's tokens/s over plain decoding's, over all the prompts."""
        return _speedup(*(tuple(map(sum, zip(*runs))) for runs in (self.plain, self.default)))

    @property
    def each(self) -> list[float]:
        """The default's speedup prompt by prompt."""
        return [_speedup(plain, default) for plain, default in zip(self.plain, self.default)]

    def expected_range(self) -> tuple[float, float]:
        """Where the speedup of as many other prompts of the same kinds is expected (95%): the
        spread of these prompts' own speedups (their logs' standard deviation), over two halves
        of as many prompts each. Prompts alike (Gemma's code edits, within 1.3x of each other)
        give a narrow range; unlike ones (a small model repeating itself on one chat prompt and
        not the next: 0.9x to 3x plain) a wide one, which no closer prediction can beat."""
        logs = np.log([s for s in self.each if s > 0])
        if len(logs) < 2:
            return self.speedup, self.speedup
        width = _Z95 * float(np.std(logs, ddof=1)) * math.sqrt(2.0 / len(logs))
        return self.speedup * math.exp(-width), self.speedup * math.exp(width)


def _speedup(plain: tuple[int, float], default: tuple[int, float]) -> float:
    """(tokens, seconds) of the default over those of plain decoding, as a speedup (0: unknown)."""
    (pn, ps), (dn, ds) = plain, default
    return (dn / ds) / (pn / ps) if ds and ps and pn else 0.0


def _decode_halves(rt, trees: dict, halves: tuple[list, list], max_tokens: int, advance,
                   deadline: float | None = None) -> tuple[dict[str, _Half], dict[str, _Half]]:
    """Decode both halves' prompts plainly (plain_tokens) and with a fresh decoder of each tree,
    in turn (runner.decode_halves, no pair of prompts starting past the `deadline` but the first
    MIN_PAIRS); return each half's {tree: _Half}, whose plain runs are its prompts' plain decoding."""
    modes = Modes(rt, {"plain": None, **trees}, fresh=True)
    halves_runs = decode_halves(modes, halves, max_tokens, deadline, after_each=lambda run: advance(),
                                tokens={"plain": plain_tokens(max_tokens)}, at_least=MIN_PAIRS)
    return tuple(_halves_of(by_mode(runs), trees) for runs in halves_runs)


def plain_tokens(max_tokens: int) -> int:
    """Plain decoding's tokens a prompt where the default decodes `max_tokens` (PLAIN_SHARE)."""
    return min(max_tokens, max(PLAIN_TOKENS, round(PLAIN_SHARE * max_tokens)))


def _halves_of(runs: dict[str, list[Run]], trees: dict) -> dict[str, _Half]:
    """{tree: _Half} of one half's runs by mode, every tree's half sharing the plain runs."""
    # (Decoding passes only: the first token comes from the prompt's pass, which would weigh more
    # in plain decoding's shorter runs.)
    plain = [run.stats.decoded for run in runs["plain"]]
    return {name: _Half(plain=plain, default=[run.stats.decoded for run in runs[name]],
                        lookup_tokens=sum(int(run.stats.total("lookup_tokens")) for run in runs[name]))
            for name in trees}
