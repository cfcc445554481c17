"""What `specrun tune` checks last: the default a run of this pair will use, per workload.

For each of bench's workloads (free chat, code edits, rewrites) the default that the new profile
makes (the tuned tree with lookup branches, or lookup alone) and plain decoding decode the same
prompts, greedily, the order alternating prompt by prompt. Every prompt gets a fresh drafter, as
a fresh process would (no session text, nothing measured yet: the profile's figures decide the
first steps). Rounds 0 and 2 of a workload's requests (one request of each kind a round) predict
its speedup; rounds 1 and 3, held out, measure it (bench_prompts.KINDS, ROUNDS).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from specrun import ui
from specrun.commands.bench_prompts import KINDS, ROUNDS, WORKLOADS
from specrun.core.sampling import SamplingParams
from specrun.decoding.plain import PlainDecoder
from specrun.decoding.stream import token_ids
from specrun.runtime.plan import tuned_default
from specrun.runtime.runtime import make_decoder


def measure_default(rt, choice, facts, n_prompts: int, max_tokens: int, progress) -> dict:
    """Return {workload: {"drafter", "predicted_speedup", "measured_speedup", ...}}; print a line each."""
    tree = tuned_default(choice, facts)
    room = rt.target_ctx.n_batch - 1 - (tree.shape.budget if tree.draft_model else 0)
    if tree.lookup is not None and tree.lookup.budget > room:
        tree = replace(tree, lookup=tree.lookup.resized(room))
        if not tree.draft_model:
            tree = replace(tree, shape=tree.lookup)
    out = {}
    per_half = _half_rounds(n_prompts)
    task = progress.add_task("the default, per workload", total=len(WORKLOADS) * 4 * len(per_half[0]))
    for name, texts in WORKLOADS.items():
        halves = {half: _decode_both(rt, tree, [rt.tokenize_prompt(texts[i], chat=True) for i in indexes],
                                     max_tokens, lambda: progress.advance(task))
                  for half, indexes in zip(("predicted", "measured"), per_half)}
        rt.clear_contexts()
        predicted, measured = halves["predicted"], halves["measured"]
        out[name] = {
            "drafter": tree.drafter,
            "predicted_speedup": round(predicted.speedup, 3),
            "measured_speedup": round(measured.speedup, 3),
            # The held-out prompts' own spread: a prediction for a workload can be no closer
            # than its prompts are alike.
            "measured_range": [round(min(measured.each), 3), round(max(measured.each), 3)],
            "lookup_tokens": measured.lookup_tokens,
            "prompts": len(predicted.plain) + len(measured.plain),
            "tokens": max_tokens,
        }
        ui.dim(f"{name}: the default ({tree.drafter}) predicted x{predicted.speedup:.2f} on {len(predicted.plain)} prompts, "
               f"measured x{measured.speedup:.2f} on {len(measured.plain)} others of the same kinds "
               f"(x{min(measured.each):.2f} to x{max(measured.each):.2f} each)")
    return out


def _half_rounds(n_prompts: int) -> tuple[list[int], list[int]]:
    """Return the indexes into a workload's prompts that predict and that measure: n_prompts in
    all, each half the same kinds, rounds alternating between the halves (0, 2: predict; 1, 3:
    measure). Fewer than two prompts a kind take the first kinds of rounds 0 and 1."""
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


def _speedup(plain: tuple[int, float], default: tuple[int, float]) -> float:
    """(tokens, seconds) of the default over those of plain decoding, as a speedup (0: unknown)."""
    (pn, ps), (dn, ds) = plain, default
    return (dn / ds) / (pn / ps) if ds and ps and pn else 0.0


def _decode_both(rt, tree, prompts: list[list[int]], max_tokens: int, advance) -> _Half:
    """Decode each prompt plainly and with a fresh default decoder, the order alternating."""
    half = _Half()
    for i, prompt in enumerate(prompts):
        for mode in ("plain", "default") if i % 2 == 0 else ("default", "plain"):
            rt.clear_contexts()
            decoder = (PlainDecoder(rt.target, rt.target_ctx) if mode == "plain"
                       else make_decoder(tree, rt.target, rt.target_ctx, rt.draft, rt.draft_ctx))
            token_ids(decoder, prompt, SamplingParams(), max_tokens)
            getattr(half, mode).append((decoder.stats.n_generated, decoder.stats.decode_s))
            if mode == "default":
                half.lookup_tokens += sum(step.lookup_tokens for step in decoder.stats.steps)
            advance()
    return half
