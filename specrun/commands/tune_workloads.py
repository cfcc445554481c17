"""What `specrun tune` checks last: the default a run of this pair will use, per workload.

For each of bench's workloads (free chat, code edits, rewrites) the default that the new profile
makes (the tuned tree with lookup branches, or lookup alone) and plain decoding decode the same
prompts, greedily, the order alternating prompt by prompt. Every prompt gets a fresh drafter, as
a fresh process would (no session text, nothing measured yet: the profile's figures decide the
first steps). The first half of a workload's prompts predicts its speedup; the second half,
held out, measures it.
"""

from __future__ import annotations

from dataclasses import replace

from specrun import ui
from specrun.commands.bench_prompts import WORKLOADS
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
    texts = {name: [rt.tokenize_prompt(t, chat=True) for t in prompts[:max(2, n_prompts)]]
             for name, prompts in WORKLOADS.items()}
    task = progress.add_task("the default, per workload", total=sum(2 * len(p) for p in texts.values()))
    for name, prompts in texts.items():
        halves = {"predicted": prompts[0::2], "measured": prompts[1::2]}
        rates, lookup_tokens = {}, 0
        for half, chosen in halves.items():
            totals = {"plain": [0, 0.0], "default": [0, 0.0]}
            for i, prompt in enumerate(chosen):
                for mode in ("plain", "default") if i % 2 == 0 else ("default", "plain"):
                    rt.target_ctx.clear()
                    if rt.draft_ctx is not None:
                        rt.draft_ctx.clear()
                    decoder = (PlainDecoder(rt.target, rt.target_ctx) if mode == "plain"
                               else make_decoder(tree, rt.target, rt.target_ctx, rt.draft, rt.draft_ctx))
                    token_ids(decoder, prompt, SamplingParams(), max_tokens)
                    totals[mode][0] += decoder.stats.n_generated
                    totals[mode][1] += decoder.stats.decode_s
                    if mode == "default" and half == "measured":
                        lookup_tokens += sum(step.lookup_tokens for step in decoder.stats.steps)
                    progress.advance(task)
            (pn, ps), (dn, ds) = totals["plain"], totals["default"]
            rates[half] = (dn / ds) / (pn / ps) if ds and ps and pn else 0.0
        rt.target_ctx.clear()
        if rt.draft_ctx is not None:
            rt.draft_ctx.clear()
        out[name] = {
            "drafter": tree.drafter,
            "predicted_speedup": round(rates["predicted"], 3),
            "measured_speedup": round(rates["measured"], 3),
            "lookup_tokens": lookup_tokens,
            "prompts": len(prompts),
            "tokens": max_tokens,
        }
        ui.dim(f"{name}: the default ({tree.drafter}) predicted x{rates['predicted']:.2f} on half the prompts, "
               f"measured x{rates['measured']:.2f} on the other half")
    return out
