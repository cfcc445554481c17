"""Lookup drafting against llama-cpp-python's prompt lookup decoding, on bench's workload prompts.

    python scripts/bench_pld.py [--workload all] [--tokens 96] [--pred 10]

Three modes per prompt, alternating in one process: llama-cpp-python's Llama greedy without a
draft model, the same with `LlamaPromptLookupDecoding` (a chain of n-gram matches from the
prompt and the text so far), and specrun's `--draft lookup` decoder. Each decodes the same
chat-formatted tokens; tokens/s counts the tokens after the first (the first comes from the
prefill in all three). Prints one line per workload: tokens/s, ratio to llama-cpp-python's plain
decoding, and whether the text equals it.
"""

from __future__ import annotations

import argparse
import time

from specrun.commands import bench
from specrun.experiments.workloads import workload_prompts
from specrun.runtime.plan import RunOptions, build_plan
from specrun.runtime.runtime import Runtime


def llama_tokens(llm, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """Greedy tokens of llama-cpp-python's Llama for prompt; seconds after the first token."""
    llm.reset()
    out: list[int] = []
    t_first = time.perf_counter()
    for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        if not out:
            t_first = time.perf_counter()
        out.append(token)
        if token == llm.token_eos() or len(out) >= max_tokens:
            break
    return out, time.perf_counter() - t_first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="all", help="chat, code, rewrite or all")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--pred", type=int, default=10, help="LlamaPromptLookupDecoding's num_pred_tokens")
    args = parser.parse_args()
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    plan = build_plan(RunOptions(draft="lookup", quiet=True))
    with Runtime(plan) as rt:
        path, threads = str(plan.files.target_path), plan.threads
        plain = llama_cpp.Llama(path, n_ctx=4096, n_batch=512, n_threads=threads, verbose=False)
        pld = llama_cpp.Llama(path, n_ctx=4096, n_batch=512, n_threads=threads, verbose=False,
                              draft_model=LlamaPromptLookupDecoding(num_pred_tokens=args.pred))
        for name, texts in workload_prompts(args.workload, None).items():
            prompts = [rt.tokenize_prompt(t, chat=True) for t in texts]
            totals = {mode: [0, 0.0] for mode in ("plain", "pld", "lookup")}
            outputs: dict[str, list] = {mode: [] for mode in totals}
            for i, prompt in enumerate(prompts):
                runs = {
                    "plain": lambda p=prompt: llama_tokens(plain, p, args.tokens),
                    "pld": lambda p=prompt: llama_tokens(pld, p, args.tokens),
                    "lookup": lambda p=prompt: _specrun(rt, p, args.tokens),
                }
                if i == 0:
                    for run in runs.values():  # warm-up
                        run()
                modes = list(runs)
                for mode in modes[i % 3:] + modes[: i % 3]:
                    out, seconds = runs[mode]()
                    totals[mode][0] += len(out) - 1
                    totals[mode][1] += seconds
                    outputs[mode].append(out)
            base = totals["plain"][0] / totals["plain"][1]
            cells = []
            for mode, (n, seconds) in totals.items():
                rate = n / seconds
                same = "" if outputs[mode] == outputs["plain"] else " (text differs)"
                cells.append(f"{mode} {rate:6.1f} tok/s x{rate / base:.2f}{same}")
            print(f"{name:>8}: " + "  ".join(cells), flush=True)


def _specrun(rt: Runtime, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    stats, out = bench._run(rt.decoder, prompt, max_tokens)
    return out, stats.decode_s - stats.steps[0].total_s  # after the first token, as above


if __name__ == "__main__":
    main()
