"""Plain decoding speed: specrun's PlainDecoder vs llama-cpp-python's Llama, same model and prompt.

    python scripts/bench_plain.py [--model PATH] [--tokens 128] [--rounds 3]

Both run greedy on the same prompt with the same thread count, alternating rounds in one
process; prints ms/token (median over rounds) for each and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

from specrun import engine
from specrun.core.sampling import SamplingParams
from specrun.decoding.plain import PlainDecoder
from specrun.decoding.stream import token_ids

PROMPT = "<|im_start|>user\nWrite a long story about a dragon who learns to cook.<|im_end|>\n<|im_start|>assistant\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF file (default: the demo target, SmolLM2-135M F32)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.model is None:
        from specrun.models import hub, registry

        args.model = str(hub.ensure_local(registry.resolve("smollm2-135m-f32")))
    import llama_cpp

    threads = engine.default_threads()
    model = engine.Model(args.model)
    ctx = engine.Context(model, n_ctx=1024, n_batch=512, threads=threads)
    plain = PlainDecoder(model, ctx)
    prompt = model.tokenize(PROMPT)
    llm = llama_cpp.Llama(args.model, n_ctx=1024, n_batch=512, n_threads=threads, verbose=False)

    def ours() -> float:
        ctx.clear()
        plain.cache.tokens.clear()
        token_ids(plain, prompt, SamplingParams(), args.tokens)
        return plain.stats.decode_s / plain.stats.n_generated

    def theirs() -> float:
        n = 0
        t0 = None
        for _ in llm.generate(prompt, temp=0.0, reset=True):
            if t0 is None:  # the first token comes from the prompt pass
                t0 = time.perf_counter()
            n += 1
            if n >= args.tokens:
                break
        return (time.perf_counter() - t0) / (n - 1)

    ours(), theirs()  # warm-up
    a, b = [], []
    for _ in range(args.rounds):
        a.append(ours())
        b.append(theirs())
    ma, mb = statistics.median(a) * 1000, statistics.median(b) * 1000
    print(f"specrun PlainDecoder: {ma:.2f} ms/token   llama-cpp-python Llama: {mb:.2f} ms/token   ratio {ma / mb:.3f}")


if __name__ == "__main__":
    main()
