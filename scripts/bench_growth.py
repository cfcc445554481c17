"""Accepted tokens per target pass against tree size, for the trees a run grows online.

    python scripts/bench_growth.py [--target smollm2-135m-f32] [--draft smollm2-135m-q4]
                                   [--shape 16,16,1,2 --shape 64,24,4,2 ...] [--max-tokens 96]
                                   [--sharpen 1] [--threads 2] [--workload chat]

For each shape (budget,depth,width,top_k; by default the sizes decoding.drafters.growing moves
between) the draft model grows that tree at every step of greedy answers to the built-in prompts
of a workload (chat by default; code edits, rewrites), and the step verifies it whole; what the target then emitted says, for every smaller
budget, how many tokens the tree's best nodes cut to that budget would have accepted (a
best-first tree's cut is its best nodes: reach.Reach). Prints accepted tokens per pass at
each budget (the curve SpecExec's paper draws) and the draft's seconds per proposal.

`--sharpen S` multiplies the draft's logits by S before the tree is scored (S > 1: a draft that
is right more often than its probabilities say). The answers are the target's whatever the tree:
acceptance, not the text, is what changes. Timings mean little on a busy machine; acceptance
does not depend on them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specrun.core.sampling import SamplingParams  # noqa: E402
from specrun.core.tree_shapes import TreeShape, grown_shape, growth_levels  # noqa: E402
from specrun.decoding.adaptive import BUDGETS  # noqa: E402
from specrun.decoding.drafters import best_first  # noqa: E402
from specrun.decoding.reach import Reach  # noqa: E402
from specrun.decoding.stream import token_ids  # noqa: E402
from specrun.experiments.workloads import WORKLOADS  # noqa: E402
from specrun.runtime.plan import RunOptions  # noqa: E402
from specrun.runtime.runtime import Runtime  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-f32")
    parser.add_argument("--draft", default="smollm2-135m-q4")
    parser.add_argument("--shape", action="append", help="budget,depth,width,top_k (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=4, help="built-in prompts of the workload to answer")
    parser.add_argument("--workload", default="chat", help="chat, code or rewrite (the built-in workloads)")
    parser.add_argument("--sharpen", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    shapes = ([TreeShape(*map(int, s.split(","))) for s in args.shape] if args.shape
              else [grown_shape(b) for b in growth_levels(16, 384)])
    if args.sharpen != 1.0:
        topk = best_first.log_softmax_topk
        best_first.log_softmax_topk = lambda rows, k: topk(rows * args.sharpen, k)
    prompts = WORKLOADS[args.workload][: args.prompts]
    opts = RunOptions(target=args.target, draft=args.draft, ctx_size=2048, quiet=True, lookup=False,
                      threads=args.threads)
    print(f"{args.target} / {args.draft}, sharpen {args.sharpen}, {len(prompts)} {args.workload} prompts x {args.max_tokens} tokens",
          file=sys.stderr)
    with Runtime(opts) as rt:
        growing = rt.decoder.drafter
        for shape in shapes:
            growing.levels, growing.shapes = (shape.budget,), [shape]
            growing.reach = Reach({b for b in BUDGETS if b <= shape.budget} | {shape.budget})
            draft_s = []
            for prompt in prompts:
                token_ids(rt.decoder, rt.tokenize_prompt(prompt, chat=True), SamplingParams(), args.max_tokens)
                draft_s += [s.draft_s for s in rt.decoder.stats.steps[2:] if s.draft_passes]
            cuts = {int(b): round(float(a), 2) for b, a in zip(growing.reach.budgets, growing.reach.accepted()) if b >= 4}
            print(f"{shape.budget:4d} nodes, depth {shape.depth:2d}, width {shape.width:2d}, top-k {shape.top_k}: "
                  f"accepted per pass by budget {cuts}; draft {1e3 * float(np.median(draft_s)):.0f} ms a proposal")


if __name__ == "__main__":
    main()
