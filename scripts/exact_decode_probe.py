"""Does speculative decoding give plain decoding's logits bit for bit? The decode-level probe.

batch_invariance_probe.py compares single pass shapes; this one runs the real decoders. For each
verify shape, every greedy answer and every log-prob in it (the chosen token's and the likeliest
alternatives') is compared with plain decoding's on the same runtime. Identical answers with
different log-probs mean the passes rounded differently and only the absence of a near-tie kept the
text the same.

Usage (repository root; the demo pair as the tests prepare it):
    python scripts/exact_decode_probe.py
    python scripts/exact_decode_probe.py --flash-attn off --no-repack --shapes chain8 tree64
    PYTHONPATH=/path/to/a/build/without/llamafile python scripts/exact_decode_probe.py --flash-attn off --no-repack
    python scripts/exact_decode_probe.py --target smollm2-135m-q4 --kv-type q8_0   # a Q4_1 target, a quantized cache
Prints one table row per verify shape: answers identical, answers whose log-probs are all
bit-identical, the largest |log-prob difference| seen before an answer parts, and where one parts,
plain decoding's gap there between its choice and the runner-up (a near-tie, or not).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specrun import sysinfo  # noqa: E402
from specrun.core.sampling import SamplingParams  # noqa: E402
from specrun.core.tree_shapes import TreeShape  # noqa: E402
from specrun.decoding.stream import make_rng  # noqa: E402
from specrun.engine import DEFAULT_KV_TYPE, KV_TYPES  # noqa: E402
from specrun.engine import context as engine_context  # noqa: E402
from specrun.engine.devices import system_info  # noqa: E402
from specrun.experiments.workloads import workload_prompts  # noqa: E402
from specrun.models import hub, registry  # noqa: E402
from specrun.runtime.drafters import BEST_FIRST  # noqa: E402
from specrun.runtime.plan import RunOptions  # noqa: E402
from specrun.runtime.runtime import Runtime, make_decoder  # noqa: E402
from specrun.runtime.trees import TreePlan  # noqa: E402

# name: (budget, depth, width, top-k); width and top-k 1 make a chain
SHAPES = {
    "chain8": TreeShape(8, 8, 1, 1),
    "chain16": TreeShape(16, 16, 1, 1),
    "tree8": TreeShape(8, 16, 8, 8),
    "tree64": TreeShape(64, 16, 8, 8),
}
N_TOP = 4


def answer(decoder, prompt, max_tokens):
    """Return the greedy answer's tokens and, per token, its log-prob and the alternatives'."""
    tokens, logprobs = [], []
    for step in decoder.steps(prompt, SamplingParams(logprobs=N_TOP), max_tokens, make_rng(None)):
        tokens.extend(step.tokens)
        logprobs.extend((lp.logprob, lp.top) for lp in step.logprobs)
    return tokens, logprobs


def largest_difference(a, b) -> float:
    """The largest |log-prob difference| of the same token at the same place, up to where the two
    answers part (after it they score different texts)."""
    worst = 0.0
    for (lp_a, top_a), (lp_b, top_b) in zip(a, b):
        worst = max(worst, abs(lp_a - lp_b), *(abs(x[1] - y[1]) for x, y in zip(top_a, top_b) if x[0] == y[0]))
        if top_a and top_b and top_a[0][0] != top_b[0][0]:  # (greedy: the first is the choice)
            break
    return worst


def parting_gap(tokens, plain_tokens, plain_logprobs) -> float | None:
    """Where an answer parts from plain decoding's: plain decoding's gap there between its choice
    and the runner-up, in nats (None: it does not part)."""
    for i, (ours, theirs) in enumerate(zip(tokens, plain_tokens)):
        if ours != theirs:
            top = plain_logprobs[i][1]
            return top[0][1] - top[1][1] if len(top) > 1 else None
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-f32")
    parser.add_argument("--draft", default="smollm2-135m-q4")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--prompts", type=int, default=9, help="of the built-in chat, code and rewrite prompts")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-repack", action="store_true", help="turn llama.cpp's repacked weight layouts off")
    parser.add_argument("--flash-attn", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--kv-type", choices=tuple(KV_TYPES), default=DEFAULT_KV_TYPE, help="the target's KV cache (--kv-type)")
    args = parser.parse_args()
    if args.no_repack:
        sysinfo.repacking_crashes = lambda: True  # the engine's switch for llama.cpp's extra buffer types
    if args.flash_attn != "auto":
        opened = engine_context.Context.__init__

        def with_flash_attn(self, *a, **k):
            opened(self, *a, **{**k, "flash_attn": args.flash_attn})

        engine_context.Context.__init__ = with_flash_attn
    built_in = workload_prompts("all", None)
    per_kind = -(-args.prompts // 3)
    texts = [t for kind in ("chat", "code", "rewrite") for t in built_in.get(kind, [])[:per_kind]][: args.prompts]
    target, draft = (name if Path(name).exists() else str(hub.ensure_local(registry.resolve(name), progress=False))
                     for name in (args.target, args.draft))
    print(f"# {system_info()}\n# threads {args.threads}; repack {'off' if args.no_repack else 'on'}; "
          f"flash attention {args.flash_attn}; KV cache {args.kv_type}; {len(texts)} prompts, {args.max_tokens} tokens")
    print("| verified as | answers identical | log-probs bit-identical | max abs log-prob diff before parting "
          "| plain's top-two gap where each parted (nats) |")
    print("|---|---|---|---|---|")
    opts = RunOptions(target=target, draft=draft, ctx_size=2048, lookup=False, quiet=True, threads=args.threads,
                      kv_type=args.kv_type)
    largest = max(SHAPES[name].budget for name in args.shapes)
    with Runtime(opts, shape_override=TreeShape(largest, 16, 8, 8)) as rt:
        prompts = [rt.tokenize_prompt(text, chat=True) for text in texts]
        plain = [answer(make_decoder(None, rt.target, rt.target_ctx), p, args.max_tokens) for p in prompts]
        for name in args.shapes:
            tree = TreePlan(SHAPES[name], BEST_FIRST, "flags")
            decoder = make_decoder(tree, rt.target, rt.target_ctx, rt.draft, rt.draft_ctx, guard=False)
            same_text = same_logprobs = 0
            worst = 0.0
            gaps = []
            for prompt, (tokens, logprobs) in zip(prompts, plain):
                got_tokens, got_logprobs = answer(decoder, prompt, args.max_tokens)
                same_text += got_tokens == tokens
                same_logprobs += got_tokens == tokens and got_logprobs == logprobs
                worst = max(worst, largest_difference(got_logprobs, logprobs))
                gap = parting_gap(got_tokens, tokens, logprobs)
                if gap is not None:
                    gaps.append(f"{gap:.3g}")
            print(f"| {name} | {same_text}/{len(prompts)} | {same_logprobs}/{len(prompts)} | {worst:.3g} | "
                  f"{', '.join(gaps) or '-'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
