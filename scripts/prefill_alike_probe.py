"""When does a prompt's prefill come out bit for bit as alone? Prefill against prefill, measured.

batch_invariance_probe.py compares passes of several tokens with one-token passes (plain
decoding). This probe compares prefills with prefills, the two things an exact prompt cache and
exact prompts beside other requests would rest on:

- `beside`: a prompt's chunk of 30 tokens in its own pass (asking for its last row's logits), against
  the same chunk in a pass that also holds another request's tokens, before or after it, asking for
  their logits or not. Reported apart: the chunk's cells (a two-token pass on them afterwards) and
  its last row.
- `resumed`: a prompt that parts from a cached one inside the cache's last, partly filled batch.
  A fresh prefill of the new prompt (batches of --batch from the text's start) against the cached
  rows kept up to where they part and the rest decoded in one resumed pass: the last row and the
  cells, for chunks and resumed passes on both sides of 64 tokens (llama.cpp's CPU flash attention
  takes one query row at a time below 64 tokens, tiles of 64 cells from 64 on).

Usage (repository root; the offline models as the tests prepare them):
    python scripts/prefill_alike_probe.py
    python scripts/prefill_alike_probe.py --models smollm2-135m-f32 --flash-attn off
    python scripts/prefill_alike_probe.py --models /path/to/model.gguf --n-gpu-layers 999   # on a GPU
Prints one table row per model and case: the largest |logit difference| (0: bit for bit).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specrun import engine  # noqa: E402
from specrun.engine import Batch  # noqa: E402
from specrun.engine.devices import system_info  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch_invariance_probe import MODELS, model_file  # noqa: E402  (scripts/, beside this one)

TEXT_FILES = ("README.md", "docs/exactness.md", "docs/how-it-works.md")
# (other request's tokens before the chunk, after it, whether they ask for logits)
BESIDE = ((0, 2, False), (0, 2, True), (0, 12, True), (12, 0, True), (0, 33, True), (0, 34, True), (0, 100, True))
# (cached prompt's last chunk, tokens of it the new prompt shares, the new prompt's last chunk), past
# two whole batches
RESUMED = ((200, 150, 300), (200, 100, 170), (300, 200, 600), (100, 64, 128), (200, 190, 230), (50, 40, 300))


class Probe:
    def __init__(self, model, text: list[int]):
        self.text = text
        self.ctx = engine.Context(model, n_ctx=4096, n_batch=args.batch, n_seq_max=2, threads=args.threads,
                                  flash_attn=args.flash_attn)
        self.batch = Batch(args.batch, 1)

    def decode(self, entries) -> np.ndarray | None:
        """One pass of (token, position, sequence, wants logits); its logits rows, if any."""
        self.batch.clear()
        for token, pos, seq, logits in entries:
            self.batch.add(token, pos, (seq,), logits)
        self.ctx.decode(self.batch)
        return self.ctx.logits().copy() if any(e[3] for e in entries) else None

    def after(self, seq: int, n: int) -> np.ndarray:
        """A two-token pass on sequence `seq` after its n tokens: what its cells give."""
        rows = self.decode([(self.text[3000 + j], n + j, seq, True) for j in range(2)])
        self.ctx.seq_rm(seq, n, -1)
        return rows

    def beside(self, before: int, after: int, asks: bool) -> tuple[float, float]:
        """(last row, cells) of a 30-token chunk of sequence 0 beside sequence 1's tokens, against alone."""
        t = self.text

        def run(before: int, after: int) -> tuple[np.ndarray, np.ndarray]:
            self.ctx.clear()
            self.decode([(t[i], i, 0, False) for i in range(10)] + [(t[500 + i], i, 1, False) for i in range(10)])
            chunk = [(t[10 + i], 10 + i, 0, i == 29) for i in range(30)]
            other = [(t[510 + j], 10 + j, 1, asks) for j in range(before + after)]
            rows = self.decode(other[:before] + chunk + other[before:])
            return rows[before if asks else 0], self.after(0, 40)

        alone, got = run(0, 0), run(before, after)
        return float(np.abs(alone[0] - got[0]).max()), float(np.abs(alone[1] - got[1]).max())

    def prefill(self, tokens: list[int], start: int = 0) -> np.ndarray:
        """Decode tokens[start:] on the batch grid (batches end at multiples of --batch); the last row."""
        pos, row, size = start, None, args.batch
        while pos < len(tokens):
            end = min(len(tokens), (pos // size + 1) * size)
            self.batch.set_sequence(tokens[pos:end], pos, 0, "last" if end == len(tokens) else "none")
            self.ctx.decode(self.batch)
            row, pos = (self.ctx.logits_row(-1).copy() if end == len(tokens) else None), end
        return row

    def resumed(self, old_chunk: int, shared: int, new_chunk: int) -> tuple[float, float]:
        """(last row, cells): the new prompt resumed after the shared tokens of a cached one, against fresh."""
        base = 2 * args.batch
        new = self.text[: base + shared] + self.text[2000: 2000 + new_chunk - shared]
        self.ctx.clear()
        fresh = self.prefill(new), self.after(0, len(new))
        self.ctx.clear()
        self.prefill(self.text[: base + old_chunk])
        self.ctx.seq_rm(0, base + shared, -1)
        got = self.prefill(new, base + shared), self.after(0, len(new))
        return float(np.abs(fresh[0] - got[0]).max()), float(np.abs(fresh[1] - got[1]).max())


def main() -> int:
    repo = Path(__file__).resolve().parents[1]
    print(f"# {system_info()}\n# threads {args.threads}; GPU layers {args.n_gpu_layers}; batch {args.batch}; "
          f"flash attention {args.flash_attn}")
    print("| model | case | last row | cells |")
    print("|---|---|---|---|")
    for alias in args.models:
        path, label = model_file(alias)
        model = engine.Model(path, n_gpu_layers=args.n_gpu_layers)
        text = model.tokenize("\n".join((repo / f).read_text() for f in TEXT_FILES), add_special=False)
        if len(text) < 3002:
            raise SystemExit(f"{label}: the probe's text has {len(text)} tokens, fewer than it needs (3,002)")
        probe = Probe(model, text)
        for before, after, asks in BESIDE:
            row, cells = probe.beside(before, after, asks)
            side = f"{before} before" if before else f"{after} after"
            print(f"| {label} | beside: 30 of a prompt, {side}{', asking logits' if asks else ''} "
                  f"(a pass of {30 + before + after}) | {row:.3g} | {cells:.3g} |", flush=True)
        for old_chunk, shared, new_chunk in RESUMED:
            row, cells = probe.resumed(old_chunk, shared, new_chunk)
            resumed = min(new_chunk, args.batch) - shared
            print(f"| {label} | resumed: cached chunk {old_chunk}, {shared} of it kept, a pass of {resumed} "
                  f"(fresh: {min(new_chunk, args.batch)}) | {row:.3g} | {cells:.3g} |", flush=True)
        probe.ctx.close()
        model.close()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=512, help="the prefill's batch (specrun's n_batch)")
    parser.add_argument("--n-gpu-layers", type=int, default=0, help="layers on the GPU (999: all)")
    parser.add_argument("--flash-attn", choices=("auto", "on", "off"), default="auto")
    args = parser.parse_args()
    sys.exit(main())
