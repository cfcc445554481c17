"""Speed against plain decoding per workload, as users run specrun: each prompt in its own
process (`specrun generate --json`), and all of a workload's prompts in one `--jsonl` batch.

    python scripts/bench_fresh.py [--workload all] [--tokens 160] [--rounds 2] [--prompts N] [--batch]
                                  [--modes default,lookup,tree] [-- more generate options]

Modes: plain (`--no-spec`), default (no flag: what the stored profile, or none, makes),
lookup (`--draft lookup`), tree (`--no-lookup`: the draft model's tree alone); MODE@DIR runs the
mode with its profiles in DIR (`default@/tmp/none,default@/tmp/tuned`: a profile against none,
in one run; the later ones' ratios to the first are printed); MODE%SITE runs the mode with
llama-cpp-python imported from SITE, another build installed with `pip install --target SITE`
(`plain,plain%/tmp/nolf,default,default%/tmp/nolf`: a build without llamafile against the
installed one; the later ones' ratios to the mode alone are printed); MODE+--OPTION=VALUE adds
`generate` options to that mode alone (`plain,plain+--kv-type=q8_0,default,default+--kv-type=q8_0`:
a quantized KV cache against the default one; ratios to the mode alone printed). They alternate
prompt by prompt (and round by round, in the other order), so a drifting machine hits all alike.
Tokens/s counts decoding after the prefill (the draft's catch-up included), from each answer's
own stats; model loading is not timed. SPECRUN_PROFILES picks the profile directory (a fresh
one: no profile). Prints one line per workload and mode: tokens/s, ratio to plain, tokens per
pass, share of tokens from lookup, prompt tokens/s (the prefill); and the default's ratio to
lookup alone and to the tree alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from specrun.experiments.workloads import workload_prompts

FLAGS = {"plain": ["--no-spec"], "default": [], "lookup": ["--draft", "lookup"], "tree": ["--no-lookup"]}


def _run(mode: str, requests: list[dict], tokens: int, extra: list[str]) -> list[dict]:
    """Answer the requests in one `specrun generate --jsonl` process; return each answer's stats."""
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for request in requests:
            f.write(json.dumps({**request, "max_tokens": tokens, "chat": True}) + "\n")
    mode, *more = mode.split("+")
    extra = [*extra, *(part for option in more for part in option.split("=", 1))]
    mode, _, site = mode.partition("%")
    flags, _, profiles = mode.partition("@")
    env = dict(os.environ)
    if profiles:
        env["SPECRUN_PROFILES"] = profiles
    if site:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "specrun", "generate", "--jsonl", "--file", f.name, *FLAGS[flags], *extra]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
    Path(f.name).unlink()
    if done.returncode != 0:
        raise SystemExit(f"{mode}: {done.stderr.strip()}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    for row in rows:
        if "error" in row:
            raise SystemExit(f"{mode}: {row['error']}")
    return [row["stats"] for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="all")
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default="plain,default,lookup,tree")
    parser.add_argument("--prompts", type=int, default=0, help="the first N prompts of each workload (0: all)")
    parser.add_argument("--batch", action="store_true", help="a workload's prompts in one --jsonl process per mode")
    parser.add_argument("extra", nargs="*", help="more `specrun generate` options (after --)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if "plain" not in modes:
        modes.insert(0, "plain")
    for name, texts in workload_prompts(args.workload, None).items():
        texts = texts[: args.prompts or None]
        totals = {m: [0, 0.0, 0, 0, 0, 0.0] for m in modes}  # tokens, seconds, passes, lookup tokens, prefill
        units = [[{"prompt": t} for t in texts]] if args.batch else [[{"prompt": t}] for t in texts]
        turn = 0
        for r in range(args.rounds):
            for unit in units:
                order = modes[turn % len(modes):] + modes[: turn % len(modes)]
                turn += 1
                for mode in order if r % 2 == 0 else order[::-1]:
                    for stats in _run(mode, unit, args.tokens, args.extra):
                        t = totals[mode]
                        t[0] += stats["n_tokens"]
                        t[1] += stats["decode_s"]
                        t[2] += stats["n_passes"]
                        t[3] += stats["lookup_tokens"]
                        t[4] += stats["n_prompt"]
                        t[5] += stats["prefill_s"]
        rate = {m: t[0] / t[1] if t[1] else 0.0 for m, t in totals.items()}
        for m, t in totals.items():
            print(f"{name:>8} {m:>8}: {rate[m]:7.2f} tok/s  x{rate[m] / rate['plain']:.3f} plain  "
                  f"{t[0] / max(t[2], 1):.2f} tokens/pass  {t[3] / max(t[0], 1):.0%} from lookup  "
                  f"prompt {t[4] / t[5] if t[5] else 0:.0f} tok/s", flush=True)
        if "default" in rate:
            for other in ("lookup", "tree"):
                if other in rate and rate[other]:
                    print(f"{name:>8}  default / {other}: x{rate['default'] / rate[other]:.3f}", flush=True)
        for m in modes:
            for mark in "+%":  # a mode with more options, or on another build, against the mode alone
                alone = m.partition(mark)[0]
                if mark in m and rate.get(alone):
                    print(f"{name:>8}  {m} / {alone}: x{rate[m] / rate[alone]:.3f}", flush=True)
        profiled = [m for m in modes if "@" in m]
        for m in profiled[1:]:
            print(f"{name:>8}  {m} / {profiled[0]}: x{rate[m] / rate[profiled[0]]:.3f}", flush=True)


if __name__ == "__main__":
    main()
