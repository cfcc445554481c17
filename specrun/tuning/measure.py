"""Measures the model pair for the tuner: forward-pass cost curves, plain decoding, draft acceptance.

Two kinds of measurement, both on the models and contexts the user will decode with (the machine
itself is hardware.machine's):

- `measure_curve`: seconds for one forward pass over n tokens appended to a real prompt, for
  n = 1, 2, 4, ... (warm-up, repeats, medians, a time budget). For the draft it includes the top-k
  over the logits, which every draft pass pays in Python.
- `calibrate`: speculative decoding at the largest budget on built-in prompts, greedy. Each step
  records the best-first ranks of the accepted path, so tau(B) for every smaller budget follows
  from this one run (tuner.tau_curve); the draft's rank of every token the target emitted gives the
  positional acceptance rates of the Sequoia tree.

Timings here are medians over repeats: a 2-core machine shared with other work is noisy.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from specrun.core.sampling import SamplingParams, log_softmax_topk, make_rng
from specrun.decoding.drafters.best_first import TreeGrower
from specrun.decoding.plain import PlainDecoder
from specrun.decoding.speculative import SpeculativeDecoder
from specrun.decoding.stream import token_ids
from specrun.engine import Batch
from specrun.tuning import cost_model as tuner

log = logging.getLogger("specrun.profiler")

# Built-in calibration prompts: the kinds of text people decode (chat, code, prose), where a draft
# agrees with its target to different degrees. The held-out prompts check the prediction on text
# the calibration did not see.
CALIBRATION_PROMPTS: tuple[tuple[str, str], ...] = (
    ("chat", "What is the difference between a list and a tuple in Python? Answer briefly."),
    ("code", "Write a Python function that checks whether a string is a palindrome, with a docstring."),
    ("prose", "Write a short story about a robot who learns to paint."),
    ("chat", "Give me three tips for sleeping better."),
    ("code", "Write a JavaScript function that removes duplicates from an array."),
    ("prose", "Describe a quiet morning in a mountain village."),
)
HELD_OUT_PROMPTS: tuple[tuple[str, str], ...] = (
    ("chat", "Explain what a hash table is to a new programmer."),
    ("code", "Write a Python class for a stack with push, pop and peek methods."),
    ("prose", "Write a letter from a sailor to his family at home."),
)

# Sizes of the cost curves: powers of two, like the batch-size steps llama.cpp's kernels take.
MAX_CURVE_TOKENS = 2048

# Draft ranks beyond this count as "not proposed" for the Sequoia positional rates: trees never
# give a node more children than this (the DP would give the rest near-zero value anyway).
MAX_CHILD_RANK = 8


# --------------------------------------------------------------------------------------------
# Cost curves


@dataclass(frozen=True)
class CurveMeasurement:
    """Median seconds per forward pass by batch size: decoding, and the top-k after it (if asked)."""

    decode: dict[int, float]
    topk: dict[int, float]
    steps: tuple[int, ...] = ()  # sizes where a new cost regime starts (offload.cost_steps)
    context_s: float = 0.0  # seconds the context's own prefill took (its prompt rate)

    def curve(self) -> tuner.CostCurve:
        """Return the cost of a pass as the decoders pay it (decode plus top-k), never decreasing
        within a cost regime.

        Within a regime a pass over more tokens never costs less; a smaller size measured slower
        than a bigger one was slowed by other work, so it takes the bigger size's time (a lower
        envelope). Across a step (e.g. op offload from 32 tokens) a bigger batch may truly cost
        less, so the envelope stops there.
        """
        sizes = sorted(self.decode)
        seconds = [self.decode[n] + self.topk.get(n, 0.0) for n in sizes]
        for i in range(len(seconds) - 2, -1, -1):
            if not any(sizes[i] < step <= sizes[i + 1] for step in self.steps):
                seconds[i] = min(seconds[i], seconds[i + 1])
        return tuner.CostCurve(tuple(sizes), tuple(seconds))

    def topk_curve(self) -> tuner.CostCurve | None:
        return tuner.CostCurve.from_points(self.topk) if self.topk else None


def curve_sizes(largest: int, steps: Sequence[int] = ()) -> list[int]:
    """Return 1, 2, 4, ... up to the first power of two >= largest (capped at MAX_CURVE_TOKENS),
    plus both sides (step - 1 and step) of every cost step within that range, so the curve does
    not interpolate across a jump."""
    largest = max(1, min(largest, MAX_CURVE_TOKENS))
    sizes = {2**i for i in range(math.ceil(math.log2(largest)) + 1)}
    for step in steps:
        if 1 < step <= max(sizes):
            sizes.update((step - 1, step))
    return sorted(sizes)


def measure_curve(
    ctx,
    context_tokens: Sequence[int],
    sizes: Sequence[int],
    *,
    repeats: int = 3,
    deadline: float | None = None,
    stop_ratio: float | None = None,
    top_k: int = 0,
    on_size: Callable[[int, float], None] | None = None,
    steps: Sequence[int] = (),
    beside: int = 0,
) -> CurveMeasurement:
    """Return median seconds to decode n tokens after `context_tokens`, for each n in `sizes`.

    The batch asks logits for every token, as a tree pass does, and is removed from the cache
    after each pass, so every repeat sees the same context. First one warm-up pass per size, in
    increasing order, which also picks the sizes: it stops at the `deadline` (time.monotonic())
    or after a size costs more than `stop_ratio` times the smallest (no tree that big can pay).
    Then `repeats` rounds over those sizes, round-robin, so a burst of load elsewhere slows every
    size a little instead of one size a lot; a size the deadline left without a timed pass keeps
    its warm-up time. `beside`: that many other sequences (ids 1, 2, ...) hold the context too,
    each in cells of its own (a server's other requests' texts in its shared cache), evaluated
    after the timed context's own prefill.
    """

    sizes = sorted(n for n in set(sizes) if 1 <= n <= ctx.n_batch)
    if not sizes:
        raise ValueError(f"no curve size fits the context's batch of {ctx.n_batch} tokens")
    context = list(context_tokens)
    if (1 + beside) * len(context) + sizes[-1] > ctx.n_ctx:
        raise ValueError("the context is too small for the prompt plus the largest batch")
    batch = Batch(max(sizes[-1], min(len(context), ctx.n_batch)), 1)
    ctx.clear()

    def prefill(seq: int) -> None:
        for start in range(0, len(context), batch.capacity):
            batch.set_sequence(context[start : start + batch.capacity], start, seq, "none")
            ctx.decode(batch)

    t_context = time.perf_counter()
    prefill(0)
    context_s = time.perf_counter() - t_context
    for seq in range(1, 1 + beside):
        prefill(seq)
    p0 = len(context)
    filler = (context * (sizes[-1] // max(len(context), 1) + 1))[: sizes[-1]] or [0] * sizes[-1]

    def one_pass(n: int) -> tuple[float, float]:
        batch.set_sequence(filler[:n], p0, 0, "all")
        t0 = time.perf_counter()
        ctx.decode(batch)
        t1 = time.perf_counter()
        if top_k:
            log_softmax_topk(ctx.logits(), top_k)
        t2 = time.perf_counter()
        ctx.seq_rm(0, p0, -1)
        return t1 - t0, t2 - t1

    def out_of_time() -> bool:
        return deadline is not None and time.monotonic() > deadline

    warm: dict[int, tuple[float, float]] = {}
    timed: dict[int, list[tuple[float, float]]] = {}
    try:
        one_pass(sizes[0])  # the first pass of a context allocates its buffers
        for n in sizes:
            warm[n] = one_pass(n)
            timed[n] = []
            too_slow = stop_ratio is not None and warm[n][0] > stop_ratio * warm[sizes[0]][0]
            if too_slow and not out_of_time():
                # One slow pass may be a burst of other work: stop only if a second agrees.
                warm[n] = min(warm[n], one_pass(n))
                too_slow = warm[n][0] > stop_ratio * warm[sizes[0]][0]
            if on_size is not None:
                on_size(n, warm[n][0])
            if out_of_time() or too_slow:
                break
        for _ in range(repeats):
            if out_of_time():
                break
            for n in timed:
                timed[n].append(one_pass(n))
    finally:
        ctx.clear()
    samples = {n: timed[n] or [warm[n]] for n in timed}
    return CurveMeasurement(
        {n: statistics.median(d for d, _ in s) for n, s in samples.items()},
        {n: statistics.median(k for _, k in s) for n, s in samples.items()} if top_k else {},
        tuple(steps),
        context_s,
    )


@dataclass(frozen=True)
class PlainTiming:
    """Plain decoding as the decoder runs it: median target pass and median Python time per token."""

    target_s: float
    overhead_s: float
    tokens_per_s: float


def measure_plain(model, ctx, prompt: Sequence[int], n_tokens: int = 16) -> PlainTiming:
    """Return plain decoding's per-token costs over a short greedy generation."""

    ctx.clear()
    decoder = PlainDecoder(model, ctx)
    token_ids(decoder, prompt, SamplingParams(), n_tokens)
    steps = decoder.stats.steps[1:] or decoder.stats.steps  # the first pass pays allocations
    ctx.clear()
    return PlainTiming(
        target_s=statistics.median(s.target_s for s in steps),
        overhead_s=statistics.median(s.overhead_s for s in steps),
        tokens_per_s=decoder.stats.tokens_per_s or 0.0,
    )


# --------------------------------------------------------------------------------------------
# Acceptance calibration


@dataclass(frozen=True)
class StepRecord:
    """One speculative step of the calibration run, as the tuner needs it."""

    path_ranks: tuple[int, ...]
    tree_nodes: int
    draft_passes: int
    expansions: int  # tree nodes the draft expanded (decoded) while growing the tree
    catchup_tokens: int  # tokens the draft decoded to catch up with the text (bonus token included)
    target_s: float
    draft_s: float
    total_s: float
    first: bool  # the first step of a prompt: the draft also prefilled the prompt

    @property
    def overhead_s(self) -> float:
        return max(0.0, self.total_s - self.target_s - self.draft_s)

    def to_dict(self) -> dict:
        return {
            "path_ranks": list(self.path_ranks),
            "tree_nodes": self.tree_nodes,
            "draft_passes": self.draft_passes,
            "expansions": self.expansions,
            "catchup_tokens": self.catchup_tokens,
            "target_s": self.target_s,
            "draft_s": self.draft_s,
            "total_s": self.total_s,
            "first": self.first,
        }

    @classmethod
    def from_dict(cls, data: dict) -> StepRecord:
        return cls(
            tuple(int(r) for r in data["path_ranks"]), int(data["tree_nodes"]), int(data["draft_passes"]),
            int(data["expansions"]), int(data["catchup_tokens"]), float(data["target_s"]),
            float(data["draft_s"]), float(data["total_s"]), bool(data["first"]),
        )


@dataclass
class Calibration:
    """What one speculative run at the largest budget tells about smaller trees.

    `draft_ranks` holds, for every token the target emitted, its rank in the draft's prediction
    at that point (1 = the draft's top token, 0 = beyond MAX_CHILD_RANK).
    """

    budget: int
    depth: int
    width: int
    top_k: int
    steps: list[StepRecord] = field(default_factory=list)
    draft_ranks: list[int] = field(default_factory=list)
    n_tokens: int = 0
    seconds: float = 0.0

    def tau(self, budgets: Sequence[int], max_depth: int | None = None) -> dict[int, float]:
        """Return accepted tokens per pass (bonus included) for each budget <= the calibration budget."""
        usable = [b for b in budgets if 1 <= b <= self.budget]
        return tuner.tau_curve([s.path_ranks for s in self.steps], usable, max_depth)

    def tau_by_depth(self, budgets: Sequence[int], depths: Sequence[int]) -> dict[int, dict[int, float]]:
        """Return tau curves for depth limits up to the calibrated depth (lower bounds below it)."""
        return {d: self.tau(budgets, d) for d in sorted(set(depths)) if 1 <= d <= self.depth}

    def accept_probs(self, max_rank: int = MAX_CHILD_RANK) -> list[float]:
        """Return the positional acceptance rates a_k, k = 1..max_rank (Sequoia)."""
        return [float(a) for a in tuner.positional_acceptance(self.draft_ranks, max_rank)]

    def branching(self) -> float:
        """Return tree nodes kept per expanded node (the tuner's SpecExec draft-cost model)."""
        nodes = sum(s.tree_nodes for s in self.steps)
        expanded = sum(s.expansions for s in self.steps)
        return nodes / expanded if expanded else tuner.DEFAULT_BRANCHING

    def catchup_tokens(self) -> float:
        """Return the median tokens of the draft's first pass of a step (catching up with the text).

        The tuner's Sequoia cost counts that pass as one token wide; it is wider when the
        target accepted tree leaves the draft never decoded.
        """
        values = [s.catchup_tokens for s in self.steps if not s.first]
        return float(statistics.median(values)) if values else 1.0

    def overhead_s(self, topk: tuner.CostCurve | None) -> float:
        """Return the median per-step time outside target and draft passes (bookkeeping, Python).

        Step overhead includes the draft's top-k after each expansion pass; the draft curve
        already counts that, so it is taken out here.
        """
        return self._overhead(topk, per_pass=False)

    def overhead_per_pass_s(self, topk: tuner.CostCurve | None) -> float:
        """Return the median step overhead per forward pass (draft passes + the target's one)."""
        return self._overhead(topk, per_pass=True)

    def _overhead(self, topk: tuner.CostCurve | None, per_pass: bool) -> float:
        values = []
        for s in self.steps:
            if s.first:
                continue  # the draft's prompt prefill is not a per-step cost
            expansion_passes = max(s.draft_passes - 1, 0)
            topk_s = 0.0
            if topk is not None and expansion_passes:
                topk_s = expansion_passes * topk.t(s.expansions / expansion_passes)
            overhead = max(0.0, s.overhead_s - topk_s)
            values.append(overhead / (s.draft_passes + 1) if per_pass else overhead)
        return statistics.median(values) if values else 0.0

    def summary(self) -> dict:
        steps = self.steps
        return {
            "budget": self.budget,
            "depth": self.depth,
            "width": self.width,
            "top_k": self.top_k,
            "n_steps": len(steps),
            "n_tokens": self.n_tokens,
            "seconds": round(self.seconds, 3),
            "accepted_per_pass": round(self.n_tokens / len(steps), 3) if steps else 0.0,
            "branching": round(self.branching(), 3),
        }

    def to_dict(self) -> dict:
        return {**self.summary(), "steps": [s.to_dict() for s in self.steps], "draft_ranks": list(self.draft_ranks)}

    @classmethod
    def from_dict(cls, data: dict) -> Calibration:
        return cls(
            budget=int(data["budget"]), depth=int(data["depth"]), width=int(data["width"]),
            top_k=int(data["top_k"]), steps=[StepRecord.from_dict(s) for s in data["steps"]],
            draft_ranks=[int(r) for r in data["draft_ranks"]], n_tokens=int(data["n_tokens"]),
            seconds=float(data["seconds"]),
        )


class _DraftCounter:
    """Stands in for the draft context and counts the tokens of the grower's passes: expansions
    (the grower's own batch) and catching up with the committed text (any other batch)."""

    def __init__(self, ctx):
        self._ctx = ctx
        self.expansion_batch = None
        self.expanded = 0
        self.caught_up = 0

    def decode(self, batch) -> None:
        if batch is self.expansion_batch:
            self.expanded += batch.n_tokens
        else:
            self.caught_up += batch.n_tokens
        self._ctx.decode(batch)

    def __getattr__(self, name):
        return getattr(self._ctx, name)


def calibrate(
    target,
    target_ctx,
    draft,
    draft_ctx,
    prompts: Sequence[Sequence[int]],
    shape,
    max_tokens: int,
    *,
    deadline: float | None = None,
    on_step: Callable[[int], None] | None = None,
) -> Calibration:
    """Run greedy speculative decoding with `shape` over the prompts and record every step.

    Stops early at the `deadline` (time.monotonic()), keeping what was recorded; at least one
    step is always taken.
    """

    cal = Calibration(shape.budget, shape.depth, shape.width, shape.top_k)
    greedy = SamplingParams()
    sequences: list[tuple[list[int], int]] = []
    t_start = time.perf_counter()
    target_ctx.clear()
    draft_ctx.clear()
    counter = _DraftCounter(draft_ctx)
    grower = TreeGrower(draft, counter, shape)
    counter.expansion_batch = grower.batch
    decoder = SpeculativeDecoder(target, target_ctx, grower, shape)
    for prompt in prompts:
        if cal.steps and deadline is not None and time.monotonic() > deadline:
            break
        generated: list[int] = []
        first = True
        for step in decoder.steps(list(prompt), greedy, max_tokens, make_rng(None)):
            generated.extend(step.tokens)
            if step.tree_nodes == 0:  # no room left to draft: not a tree step
                continue
            cal.steps.append(
                StepRecord(
                    tuple(step.path_ranks), step.tree_nodes, step.draft_passes, counter.expanded,
                    counter.caught_up, step.target_s, step.draft_s, step.total_s, first,
                )
            )
            counter.expanded = counter.caught_up = 0
            first = False
            if on_step is not None:
                on_step(len(step.tokens))
            if deadline is not None and time.monotonic() > deadline:
                break
        sequences.append((list(prompt) + generated, len(prompt)))
        cal.n_tokens += len(generated)
    cal.seconds = time.perf_counter() - t_start
    target_ctx.clear()
    for tokens, start in sequences:
        cal.draft_ranks.extend(draft_ranks(draft_ctx, tokens, start))
    draft_ctx.clear()
    return cal


def draft_ranks(ctx, tokens: Sequence[int], start: int, max_rank: int = MAX_CHILD_RANK) -> list[int]:
    """Return the draft's rank of tokens[i] given tokens[:i], for i = start..len-1 (0 = beyond max_rank).

    One prefill of the whole text with logits for every position: the rank of the target's token
    at each point of its own greedy path is exactly the event Sequoia's positional rates count.
    """

    if start < 1 or start >= len(tokens):
        return []
    ctx.clear()
    batch = Batch(min(ctx.n_batch, len(tokens)), 1)
    ranks: list[int] = []
    inputs = list(tokens[:-1])
    for chunk_start in range(0, len(inputs), batch.capacity):
        chunk = inputs[chunk_start : chunk_start + batch.capacity]
        batch.set_sequence(chunk, chunk_start, 0, "all")
        ctx.decode(batch)
        logits = ctx.logits()
        rows = np.arange(len(chunk))
        wanted = max(start - 1 - chunk_start, 0)
        rows = rows[wanted:]
        if rows.size == 0:
            continue
        nexts = np.asarray(tokens[chunk_start + 1 : chunk_start + 1 + len(chunk)])[wanted:]
        chosen = logits[rows, nexts]
        rank = 1 + (logits[rows] > chosen[:, None]).sum(axis=1)
        ranks.extend(int(r) if r <= max_rank else 0 for r in rank)
    ctx.clear()
    return ranks
