"""The one experiment loop: several modes of decoding the same prompts, taking turns.

Every figure `bench` and `tune` report compares modes (plain decoding, a drafter, a tree of some
size) on the same prompts, greedily, the modes' order rotating prompt by prompt: a machine whose
speed moves during the minutes an experiment takes moves every mode alike (run one after the
other, a prediction made while plain passes ran at 105 tok/s was checked against prompts decoded
at 78, and missed by 30% for that alone). A mode's decoder is fresh for every prompt, as a new
process decodes (nothing learnt, the profile's figures deciding the first steps), or shared, one
per mode, its drafter's session state (the lookup index) carried from prompt to prompt as a
server's is. Held-out halves take turns the same way, a prompt of one half then one of the other.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from specrun.core.sampling import SamplingParams, make_rng
from specrun.decoding.steps import GenerationStats
from specrun.runtime.runtime import Runtime, make_decoder
from specrun.runtime.trees import TreePlan


@dataclass
class Run:
    """One mode's decoding of one prompt."""

    mode: str
    prompt: int  # the prompt's index among the experiment's prompts
    stats: GenerationStats
    tokens: list[int]


class Modes:
    """The decoders an experiment compares, by mode name: each a tree plan (None: plain decoding),
    fresh for every prompt or shared (built once, reset between prompts). `guard`: a speed guard
    shrinks a tree that measures slower than plain decoding, as in a run (False: trees as given)."""

    def __init__(self, rt: Runtime, trees: dict[str, TreePlan | None], fresh: bool, guard: bool = True):
        self.rt, self.trees, self.fresh, self.guard = rt, trees, fresh, guard
        self._shared = {} if fresh else {mode: self._new(tree) for mode, tree in trees.items()}

    @property
    def names(self) -> list[str]:
        return list(self.trees)

    def decoder(self, mode: str):
        """Return the mode's decoder over empty caches: a new one, or the mode's own, reset."""
        if self.fresh:
            self.rt.clear_contexts()
            return self._new(self.trees[mode])
        decoder = self._shared[mode]
        decoder.reset()
        return decoder

    def _new(self, tree: TreePlan | None):
        rt = self.rt
        return make_decoder(tree, rt.target, rt.target_ctx, rt.draft, rt.draft_ctx, guard=self.guard,
                            overlap=rt.overlap, network_sizes=rt.network_sizes, network_s=rt.network_s)


def decode_in_turn(modes: Modes, prompts: Sequence[Sequence[int]], max_tokens: int, *, warm_up: int = 0,
                   deadline: float | None = None, seconds_each: float | None = None, group: int = 1,
                   after_each: Callable[[Run], None] | None = None,
                   tokens: Mapping[str, int] | None = None, at_least: int = 1) -> list[Run]:
    """Decode every prompt greedily in every mode, the modes' order rotating prompt by prompt (a,
    b, c; then b, c, a; ...); return the runs in the order they ran, calling `after_each` on each.
    Each mode decodes `max_tokens` a prompt, or what `tokens` gives it.

    First every mode decodes `warm_up` tokens of the first prompt, untimed (first decodes pay
    one-time allocations). Past the `deadline` (time.monotonic()) no further group of `group`
    prompts starts (the first `at_least` groups always run, and a group started runs whole);
    `seconds_each` stops a decode that runs longer.
    """
    names = modes.names
    if warm_up:
        for mode in names:
            _decode(modes.decoder(mode), prompts[0], warm_up)
    runs: list[Run] = []
    for i, prompt in enumerate(prompts):
        if i >= at_least * group and deadline is not None and i % group == 0 and time.monotonic() > deadline:
            break
        for mode in names[i % len(names):] + names[: i % len(names)]:
            decoder = modes.decoder(mode)
            out = _decode(decoder, prompt, (tokens or {}).get(mode, max_tokens), seconds_each)
            runs.append(Run(mode, i, decoder.stats, out))
            if after_each is not None:
                after_each(runs[-1])
    return runs


def decode_halves(modes: Modes, halves: tuple[Sequence[Sequence[int]], Sequence[Sequence[int]]], max_tokens: int,
                  deadline: float | None = None, after_each: Callable[[Run], None] | None = None,
                  tokens: Mapping[str, int] | None = None, at_least: int = 1) -> tuple[list[Run], list[Run]]:
    """Decode two halves' prompts (one predicts, one is held out) in turn: a prompt of one half, then
    one of the other, the modes rotating throughout, so that a drifting machine moves both alike;
    return each half's runs, `prompt` the index within its half. Past the `deadline` no further
    pair of prompts starts but the first `at_least`: the halves always hold as many prompts, of the
    same kinds. `tokens`: as decode_in_turn's."""
    prompts = [prompt for pair in zip(*halves) for prompt in pair]
    runs = decode_in_turn(modes, prompts, max_tokens, deadline=deadline, group=2, after_each=after_each, tokens=tokens,
                          at_least=at_least)
    first, second = ([replace(run, prompt=run.prompt // 2) for run in runs if run.prompt % 2 == half] for half in (0, 1))
    return first, second


def by_mode(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """Return the runs of each mode, in the order they ran."""
    out: dict[str, list[Run]] = {}
    for run in runs:
        out.setdefault(run.mode, []).append(run)
    return out


def merged(runs: Sequence[Run]) -> GenerationStats:
    """Return the runs' stats as one generation's: tokens, decoding seconds and steps summed."""
    total = GenerationStats()
    for run in runs:
        total.n_generated += run.stats.n_generated
        total.decode_s += run.stats.decode_s
        total.steps.extend(run.stats.steps)
    return total


def _decode(decoder, prompt: Sequence[int], max_tokens: int, seconds: float | None = None) -> list[int]:
    """Return the ids a greedy decode generates, stopping after max_tokens or once `seconds` have
    passed (None: no limit)."""
    params = SamplingParams()
    stop_at = time.monotonic() + seconds if seconds is not None else math.inf
    out: list[int] = []
    for step in decoder.steps(prompt, params, max_tokens, make_rng(params.seed)):
        out.extend(step.tokens)
        if time.monotonic() > stop_at:
            break
    return out
