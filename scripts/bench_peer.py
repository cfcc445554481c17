"""specrun against llama.cpp's own tools on the same prompts, each prompt in its own process.

    python scripts/bench_peer.py --bin LLAMA_CPP/build/bin [--workload code] [--tokens 160]
                                 [--prompts N] [--rounds 2] [--threads T]
                                 [--modes plain,default,lookup,cpp-plain,cpp-ngram-cache,cpp-ngram-simple]
                                 [-- more specrun generate options, e.g. --target gemma3-270m-f32]

Build llama.cpp's tools from the same pinned sources (vendor/llama.cpp in the llama-cpp-python
sdist): `cmake -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release &&
cmake --build build -j2 --target llama-completion llama-speculative-simple`.

Each prompt is rendered with specrun's chat template and given to llama.cpp as that text, so both
read the same tokens (checked: the script stops if llama.cpp's tokenization would differ). Greedy,
the same thread count. Modes alternate prompt by prompt (and round by round, in the other order).
Tokens/s counts decoding after the prompt: specrun's own stats (`decode_s`), llama.cpp's
"decoded ... in ... seconds" (speculative-simple) and "eval time" (completion). Model loading and
prefill are not timed. Prints each mode's tokens/s and its ratio to llama.cpp's plain decoding.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

# scripts/ is this script's own directory, first on sys.path.
from bench_fresh import _run

from specrun import sysinfo
from specrun.experiments.workloads import WORKLOADS
from specrun.runtime.plan import RunOptions
from specrun.runtime.runtime import Runtime

_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_EVAL = re.compile(r"^.*?\beval time =\s+([\d.]+) ms /\s+(\d+) (?:runs|tokens)", re.MULTILINE)


def _rendered(texts: list[str], target: str | None) -> tuple[list[str], dict]:
    """Each prompt as the text of its chat-template rendering, and the model paths and threads."""
    options = RunOptions(target=target, quiet=True) if target else RunOptions(quiet=True)
    out = []
    with Runtime(options) as rt:
        model = rt.target
        bos = model.tokenize("", add_special=True, parse_special=True)
        for text in texts:
            ids = rt.tokenize_prompt(text, chat=True)
            body = ids[len(bos):] if bos and ids[: len(bos)] == bos else ids
            rendered = model.detokenize(body, special=True)
            if model.tokenize(rendered, add_special=True, parse_special=True) != ids:
                raise SystemExit("llama.cpp would read another token sequence for a rendered prompt")
            out.append(rendered)
        paths = {"target": str(rt.plan.files.target_path), "threads": rt.plan.threads}
    return out, paths


def _specrun(mode: str, text: str, tokens: int, extra: list[str]) -> tuple[int, float]:
    stats = _run(mode, [{"prompt": text}], tokens, extra)[0]
    return stats["n_tokens"], stats["decode_s"]


def _llama(mode: str, rendered: str, tokens: int, paths: dict, binaries: Path, threads: int) -> tuple[int, float]:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(rendered)
    common = ["-m", paths["target"], "-f", f.name, "-n", str(tokens), "--temp", "0", "--top-k", "1",
              "-t", str(threads), "-tb", str(threads), "-c", "4096", "--seed", "1",
              *(["--no-repack"] if sysinfo.repacking_crashes() else [])]
    if mode == "cpp-plain":
        argv = [str(binaries / "llama-completion"), *common, "-no-cnv", "--no-display-prompt"]
    else:
        argv = [str(binaries / "llama-speculative-simple"), *common, "--spec-type", mode.removeprefix("cpp-")]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    Path(f.name).unlink()
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise SystemExit(f"{mode}: exit {done.returncode}: {log.strip()[-800:]}")
    if mode == "cpp-plain":
        found = [m for m in _EVAL.finditer(log) if "prompt eval" not in m.group(0)]
        if not found:
            raise SystemExit(f"{mode}: no eval time in its log")
        ms, runs = float(found[-1].group(1)), int(found[-1].group(2))
        return runs, ms / 1000.0
    found = _DECODED.search(log)
    if not found:
        raise SystemExit(f"{mode}: no 'decoded' line in its log")
    return int(found.group(1)), float(found.group(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", required=True, type=Path, help="llama.cpp's build/bin")
    parser.add_argument("--workload", default="code")
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=0, help="the first N prompts of each workload (0: all)")
    parser.add_argument("--threads", type=int, default=0, help="llama.cpp's threads (0: what specrun's plan uses)")
    parser.add_argument("--modes", default="cpp-plain,plain,default,lookup,cpp-ngram-cache,cpp-ngram-simple")
    parser.add_argument("extra", nargs="*", help="more `specrun generate` options (after --)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    target = args.extra[args.extra.index("--target") + 1] if "--target" in args.extra else None
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    for name in names:
        texts = WORKLOADS[name]
        texts = texts[: args.prompts or None]  # (one request of each kind a round: workloads.KINDS)
        rendered, paths = _rendered(texts, target)
        threads = args.threads or paths["threads"]
        totals = {m: [0, 0.0] for m in modes}
        turn = 0
        for r in range(args.rounds):
            for text, prompt in zip(texts, rendered):
                order = modes[turn % len(modes):] + modes[: turn % len(modes)]
                turn += 1
                for mode in order if r % 2 == 0 else order[::-1]:
                    if mode.startswith("cpp-"):
                        n, s = _llama(mode, prompt, args.tokens, paths, args.bin, threads)
                    else:
                        n, s = _specrun(mode, text, args.tokens, args.extra)
                    totals[mode][0] += n
                    totals[mode][1] += s
        rate = {m: n / s if s else 0.0 for m, (n, s) in totals.items()}
        base = rate.get("cpp-plain") or rate.get("plain")
        for m in modes:
            print(f"{name:>8} {m:>17}: {rate[m]:7.2f} tok/s  x{rate[m] / base:.3f} of llama.cpp plain "
                  f"({totals[m][0]} tokens)", flush=True)


if __name__ == "__main__":
    main()
