"""Which shapes of a pass change a token's logits, and in which op: the batch-invariance probe.

For each model, a prompt is prefilled and a continuation of 128 tokens is scored in several pass
shapes; every row is compared with plain decoding's (one token a pass, cells in order):
- `chain2` ... `chain128`: the continuation in passes of 2, 4, 8, 16 or 128 tokens (a tree's or a
  chain's verify pass, a prompt's chunk; on CUDA quantized weights take the one-row kernel up to 8);
- `beside`: each token in a one-token step that also holds another request's 15 tokens (a server
  pass of several requests);
- `scattered`: one-token passes whose cells lie out of order (a tree step's rejected branches left
  holes that later tokens filled, as speculative decoding leaves the cache);
- `tree`: each token the first of 16 siblings in one pass (a tree of width 16, depth 1);
- `offset`: plain decoding's passes, the prompt's and each token's, with another request's 37
  cells before the prompt's in the cache (a server lane whose text sits after another's).
Then, for the first token where a shape differs, `--ops` follows the token's row through every
named op of the graph (llama.cpp's eval callback) and prints the first three ops whose output
differs (the first alone can be a last bit the next op rounds away).

Usage (repository root; the offline models as the tests prepare them):
    python scripts/batch_invariance_probe.py                       # the four offline models
    python scripts/batch_invariance_probe.py --models smollm2-135m-f32 --ops
    python scripts/batch_invariance_probe.py --no-repack --flash-attn off
    python scripts/batch_invariance_probe.py --models /path/to/model.gguf --n-gpu-layers 999   # on a GPU
    python scripts/batch_invariance_probe.py --models smollm2-135m-q4 --context 1500   # a long cache
    python scripts/batch_invariance_probe.py --kv-type q8_0             # a quantized KV cache
Prints one table row per model and shape: the largest |logit difference| against plain decoding
over the 128 rows, how many rows differ at all, how many greedy choices change, and the widest
top-two gap of plain decoding that a changed choice crossed (what a near-tie threshold must cover).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specrun import engine, sysinfo  # noqa: E402
from specrun.engine import Batch  # noqa: E402
from specrun.engine import backend as engine_backend  # noqa: E402
from specrun.engine.devices import system_info  # noqa: E402
from specrun.models import hub, registry  # noqa: E402

PROMPT = ("<|im_start|>user\nExplain in a few paragraphs how a bicycle stays upright, and why riders "
          "lean into corners.<|im_end|>\n<|im_start|>assistant\n")
CONTINUATION = ("A bicycle stays upright mostly because the rider steers it back under its own centre of mass. "
                "When the bike starts to fall to one side, the front wheel turns toward that side, which moves "
                "the contact patch under the falling mass and rights it again. The geometry of the fork, called "
                "trail, makes the wheel turn by itself in the right direction, so even a riderless bicycle rolling "
                "fast enough keeps its balance for a while. Gyroscopic effects of the wheels help a little, but "
                "experiments with counter-spinning wheels show they are not needed. In a corner, gravity pulls the "
                "rider down while the turn pulls the tyres outward, and leaning balances the two forces.")
MODELS = ("smollm2-135m-f32", "smollm2-135m-q4", "gemma3-270m-f32", "gemma3-270m-q4")
N_CONT = 128
CHAINS = (2, 4, 8, 16, 128)


def model_file(alias: str) -> tuple[Path, str]:
    """A --models entry's file and its name in the table: a registry alias (downloaded as the tests
    do) or a GGUF file's path (the device kit's models)."""
    if alias.endswith(".gguf"):
        return Path(alias), Path(alias).name
    return Path(hub.ensure_local(registry.resolve(alias), progress=False)), alias


class GgmlTensor(ctypes.Structure):
    """ggml.h's struct ggml_tensor of the pinned llama.cpp (GGML_MAX_DIMS 4, GGML_MAX_SRC 10)."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


def _ggml_base():
    """llama.cpp's ggml base library as the bindings loaded it (for ggml_backend_tensor_get)."""
    import llama_cpp

    folder = Path(llama_cpp.__file__).parent / "lib"
    lib = ctypes.CDLL(str(next(folder.glob("libggml-base.*"))))
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_backend_tensor_get.restype = None
    return lib


GGML_BASE = _ggml_base()


class OpTrace:
    """The eval callback: each named F32 op's output row for one batch index, in graph order."""

    def __init__(self):
        self.index = -1  # the batch index to keep (-1: keep nothing)
        self.n_tokens = 0
        self.rows: dict[str, np.ndarray] = {}
        self.order: list[str] = []
        self.callback = engine_backend.C.ggml_backend_sched_eval_callback(self._seen)

    def _seen(self, tensor_p, ask, _user):
        if ask:
            return self.index >= 0
        t = ctypes.cast(tensor_p, ctypes.POINTER(GgmlTensor)).contents
        if t.type != 0 or not t.data:  # F32 outputs only
            return True
        dims = [int(t.ne[i]) for i in range(4)]
        # The token axis is the outermost axis of n_tokens elements (activations [n_embd, n_tokens],
        # per-head ones [head_dim, n_head, n_tokens]).
        axis = max((i for i in range(1, 4) if dims[i] == self.n_tokens), default=None)
        if axis is None or any(dims[i] != 1 for i in range(axis + 1, 4)):
            return True
        inner = int(np.prod(dims[:axis]))
        contiguous = all(int(t.nb[i]) == 4 * int(np.prod(dims[:i])) for i in range(axis + 1))
        if not contiguous:
            return True
        offset = self.index * int(t.nb[axis])
        row = np.empty(inner, dtype=np.float32)
        # ggml_backend_tensor_get reads a GPU's memory too (a host buffer is a plain copy).
        GGML_BASE.ggml_backend_tensor_get(ctypes.c_void_p(tensor_p), row.ctypes.data_as(ctypes.c_void_p),
                                          ctypes.c_size_t(offset), ctypes.c_size_t(4 * inner))
        name = t.name.decode(errors="replace")
        if name not in self.rows:
            self.order.append(name)
        self.rows[name] = row
        return True


def open_context(model, n_seq, flash_attn, trace: OpTrace | None):
    """An engine.Context; with a trace, llama.cpp's eval callback is set on its params."""
    if trace is None:
        return engine.Context(model, n_ctx=n_ctx(), n_batch=256, n_seq_max=n_seq, threads=args.threads, flash_attn=flash_attn,
                              kv_type=args.kv_type)
    real = engine_backend.C.llama_init_from_model

    def with_callback(model_ptr, params):
        params.cb_eval = trace.callback
        params.cb_eval_user_data = None
        return real(model_ptr, params)

    engine.context.C.llama_init_from_model = with_callback
    try:
        return engine.Context(model, n_ctx=n_ctx(), n_batch=256, n_seq_max=n_seq, threads=args.threads, flash_attn=flash_attn,
                              kv_type=args.kv_type)
    finally:
        engine.context.C.llama_init_from_model = real


BESIDE = 15  # the other request's tokens in each of the `beside` shape's passes


def n_ctx() -> int:
    """The cache: room for the prompt (--context), the continuation and all the other request's
    tokens of the `beside` shape, so that none of its cells is ever freed: a freed cell before the
    request's last one is a hole its next token fills, out of order (the `scattered` shape)."""
    return 1024 + args.context + BESIDE * N_CONT


def prefill(ctx, prompt, clear=True):
    if clear:
        ctx.clear()
    batch = Batch(256, 1)
    for start in range(0, len(prompt), 256):  # (a long --context in batches of 256)
        batch.set_sequence(prompt[start:start + 256], start, 0, "none")
        ctx.decode(batch)


def plain_rows(ctx, prompt, cont, clear=True):
    """Plain decoding's rows: one token a pass, cells in order."""
    prefill(ctx, prompt, clear)
    one, rows = Batch(1, 1), []
    for i, token in enumerate(cont):
        one.set_sequence([token], len(prompt) + i, 0, "last")
        ctx.decode(one)
        rows.append(ctx.logits_row(-1).copy())
    return np.array(rows)


def offset_rows(ctx, prompt, cont, other):
    """Plain decoding's rows, the prompt's cells after another request's 37 (sequence 1)."""
    ctx.clear()
    batch = Batch(256, 2)
    batch.set_sequence((other * 4)[:37], 0, 1, "none")
    ctx.decode(batch)
    return plain_rows(ctx, prompt, cont, clear=False)


def chain_rows(ctx, prompt, cont, size):
    prefill(ctx, prompt)
    batch, rows = Batch(256, 1), []
    for start in range(0, len(cont), size):
        part = cont[start:start + size]
        batch.set_sequence(part, len(prompt) + start, 0, "all")
        ctx.decode(batch)
        rows.extend(ctx.logits()[: len(part)].copy())
    return np.array(rows)


def beside_rows(ctx, prompt, cont, other):
    """Each token with another request's 15 tokens (sequence 1, its own prompt) in the pass."""
    prefill(ctx, prompt)
    batch = Batch(256, 2)
    batch.set_sequence(other[:8], 0, 1, "none")
    ctx.decode(batch)
    rows, pos1 = [], 8
    for i, token in enumerate(cont):
        batch.clear()
        batch.add(token, len(prompt) + i, [0], True)
        for j in range(BESIDE):
            batch.add(other[(pos1 + j) % len(other)], pos1 + j, [1], False)
        pos1 += BESIDE
        ctx.decode(batch)
        rows.append(ctx.logits_row(0).copy())
    return np.array(rows)


def scattered_rows(ctx, prompt, cont, rng):
    """One-token passes whose cells lie out of position order: every fourth token, decoy tokens of
    another colour take the next cells first, the token the cell after them, then the decoys go,
    so the tokens after it fill the holes before its cell (a tree step's rejected branches leave
    holes that later tokens fill, as speculative decoding leaves the cache)."""
    prefill(ctx, prompt)
    one, decoys, rows = Batch(1, 2), Batch(16, 2), []
    for i, token in enumerate(cont):
        holes = i % 4 == 0
        if holes:
            decoys.clear()
            for j in range(int(rng.integers(1, 6))):
                decoys.add(int(rng.integers(0, 1000)), len(prompt) + i + j, [1], False)
            ctx.seq_cp(0, 1)
            ctx.decode(decoys)
        one.set_sequence([token], len(prompt) + i, 0, "last")
        ctx.decode(one)
        rows.append(ctx.logits_row(-1).copy())
        if holes:
            ctx.seq_rm(1)
    return np.array(rows)


def tree_rows(ctx, prompt, cont, rng):
    """Each token as the first child of a root-less tree of 16 siblings (colours 0..15)."""
    prefill(ctx, prompt)
    batch, rows = Batch(256, 16), []
    for i, token in enumerate(cont):
        pos = len(prompt) + i
        for colour in range(1, 16):
            ctx.seq_rm(colour)
            ctx.seq_cp(0, colour)
        batch.clear()
        batch.add(token, pos, [0], True)
        for colour in range(1, 16):
            batch.add(int(rng.integers(0, 1000)), pos, [colour], True)
        ctx.decode(batch)
        rows.append(ctx.logits_row(0).copy())
        for colour in range(1, 16):
            ctx.seq_rm(colour)
    return np.array(rows)


def compare(reference, rows):
    """Return (max |diff|, rows differing, greedy choices changed, the widest plain gap a changed
    choice crossed (the plain row's best logit minus its logit of the token the shape chose), the
    first differing row or -1)."""
    diff = np.abs(rows - reference).max(axis=1)
    chosen = rows.argmax(axis=1)
    changed = np.flatnonzero(chosen != reference.argmax(axis=1))
    gap = max((float(reference[i].max() - reference[i, chosen[i]]) for i in changed), default=0.0)
    first = int(np.argmax(diff > 0)) if (diff > 0).any() else -1
    return float(diff.max()), int((diff > 0).sum()), len(changed), gap, first


def differing_ops(model, prompt, cont, shape, index, flash_attn, n=3):
    """Follow token `index` of the continuation through the graph, alone and in `shape`; return the
    first `n` ops (in graph order) whose row differs, each with its max |difference|. More than
    one: a difference of a last bit that the next op rounds away (an RMS norm's row, then the same
    product with its weight) is not where the logits part; the op after it that differs too is."""
    traced = {}
    for mode in ("plain", shape):
        trace = OpTrace()
        ctx = open_context(model, 16, flash_attn, trace)
        prefill(ctx, prompt + cont[:index] if mode == "plain" else prompt)
        if mode == "plain":
            trace.index, trace.n_tokens = 0, 1
            batch = Batch(1, 1)
            batch.set_sequence([cont[index]], len(prompt) + index, 0, "last")
        else:
            size = int(shape.removeprefix("chain"))
            start = (index // size) * size
            if start:
                head = Batch(256, 1)
                head.set_sequence(cont[:start], len(prompt), 0, "none")
                ctx.decode(head)
            part = cont[start:start + size]
            trace.index, trace.n_tokens = index - start, len(part)
            batch = Batch(256, 1)
            batch.set_sequence(part, len(prompt) + start, 0, "all")
        ctx.decode(batch)
        traced[mode] = trace
        ctx.close()
    plain, other = traced["plain"], traced[shape]
    found = []
    for name in plain.order:
        if name in other.rows and plain.rows[name].shape == other.rows[name].shape:
            delta = float(np.abs(plain.rows[name] - other.rows[name]).max())
            if delta > 0:
                found.append((name, delta))
                if len(found) == n:
                    break
    return found


def main() -> int:
    if args.no_repack:
        sysinfo.repacking_crashes = lambda: True  # the engine's switch for llama.cpp's extra buffer types
    print(f"# {system_info()}\n# threads {args.threads}; GPU layers {args.n_gpu_layers}; context {args.context}; "
          f"repack {'off' if args.no_repack else 'on'}; "
          f"flash attention {args.flash_attn}; KV cache {args.kv_type}")
    print("| model | shape | max abs diff | rows differing | greedy choices changed | widest gap crossed |"
          + (" first ops differing |" if args.ops else ""))
    print("|---|---|---|---|---|---|" + ("---|" if args.ops else ""))
    for alias in args.models:
        path, label = model_file(alias)
        model = engine.Model(path, n_gpu_layers=args.n_gpu_layers)
        prompt = model.tokenize(PROMPT)
        if args.context:  # earlier text before the question, so that the cache holds this many cells more
            filler = model.tokenize(CONTINUATION, add_special=False)
            prompt = prompt[:1] + (filler * (args.context // len(filler) + 1))[:args.context] + prompt[1:]
        cont = (model.tokenize(CONTINUATION, add_special=False) * 2)[:N_CONT]
        other = model.tokenize("Write a list of ten fruits and their colours, one per line.", add_special=False)
        ctx = open_context(model, 16, args.flash_attn, None)
        reference = plain_rows(ctx, prompt, cont)
        rng = np.random.default_rng(0)
        shapes = {
            **{f"chain{n}": (lambda n=n: chain_rows(ctx, prompt, cont, n)) for n in CHAINS},
            "beside": lambda: beside_rows(ctx, prompt, cont, other),
            "scattered": lambda: scattered_rows(ctx, prompt, cont, rng),
            "tree": lambda: tree_rows(ctx, prompt, cont, rng),
            "offset": lambda: offset_rows(ctx, prompt, cont, other),
        }
        for shape, rows_of in shapes.items():
            if args.shapes and shape not in args.shapes:
                continue
            worst, differing, flips, gap, first = compare(reference, rows_of())
            row = f"| {label} | {shape} | {worst:.3g} | {differing}/{len(cont)} | {flips} | {gap:.3g} |"
            if args.ops:
                op = "-"
                if first >= 0 and shape.startswith("chain"):
                    found = differing_ops(model, prompt, cont, shape, first, args.flash_attn)
                    op = ", ".join(f"`{name}` ({delta:.3g})" for name, delta in found) or "none traced"
                row += f" {op} |"
            print(row, flush=True)
        ctx.close()
        model.close()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-gpu-layers", type=int, default=0, help="layers on the GPU (999: all)")
    parser.add_argument("--context", type=int, default=0,
                        help="tokens of earlier text before the prompt (a long conversation's cache)")
    parser.add_argument("--no-repack", action="store_true", help="turn llama.cpp's repacked weight layouts off")
    parser.add_argument("--flash-attn", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--kv-type", choices=tuple(engine.KV_TYPES), default=engine.DEFAULT_KV_TYPE, help="the KV cache's cells (--kv-type)")
    parser.add_argument("--ops", action="store_true", help="name the first ops whose output differs")
    parser.add_argument("--shapes", nargs="+", choices=(*(f"chain{n}" for n in CHAINS), "beside", "scattered", "tree", "offset"),
                        help="only these shapes (default: all)")
    args = parser.parse_args()
    sys.exit(main())
