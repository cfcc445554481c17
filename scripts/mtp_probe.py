"""Drive a model's MTP head from Python as a drafter, with the pinned llama-cpp-python (no C++ patch).

    python scripts/mtp_probe.py --model Qwen3.5-0.8B-MTP.gguf [--tokens 48] [--draft 3]

The model must carry MTP (nextn) layers (`llama_model_n_layer_nextn` > 0): e.g. unsloth's
Qwen3.5-*-MTP-GGUF files (registry aliases qwen3.5-4b-mtp, qwen3.6-27b-mtp...). What it does,
in the order llama.cpp's own `draft-mtp` driver (common/speculative.cpp) does it:

1. loads the model with `llama_model_params.load_mtp = true`;
2. opens the target context and turns on its nextn hidden rows (`llama_set_embeddings_nextn`,
   unmasked: one row per token of every target batch);
3. opens a second context on the same model with `ctx_type = LLAMA_CONTEXT_TYPE_MTP`: it runs only
   the MTP block, fed (token, hidden row) pairs through `llama_batch_ext_set_embd_token` and
   `llama_process`;
4. decodes greedily, each step drafting a chain of `--draft` tokens with the MTP head and
   verifying pending token + drafts in one target batch; the rejected tail is rolled back
   (`llama_memory_seq_rm`; hybrids keep `n_rs_seq` recurrent snapshots for it) and the MTP
   context is caught up with the accepted tokens paired with the target's rows.

It prints the acceptance and whether the text equals plain greedy decoding of the same model
(it must: the target verifies every token). The staging functions of src/llama-ext.h are C++
symbols that llama_cpp does not bind; they are called by their mangled names (Itanium ABI: Linux
and macOS builds).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time

import numpy as np

import llama_cpp.llama_cpp as C

# src/llama-ext.h, exported with C++ linkage by libllama (Itanium-mangled names).
_STAGING = {
    "set_embeddings_nextn": ("_Z26llama_set_embeddings_nextnP13llama_contextbb",
                             [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None),
    "get_embeddings_nextn_ith": ("_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
                                 [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float)),
}
HYBRID_ROLLBACK = {"qwen35", "qwen35moe", "qwen4exp", "deepseek4", "glm5-next", "nemotron_h",
                   "nemotron_h_moe", "lfm2", "lfm2moe", "kimi-k3", "bailingmoe3"}


def staging(name: str):
    symbol, argtypes, restype = _STAGING[name]
    try:
        fn = getattr(C._lib, symbol)
    except AttributeError:
        sys.exit(f"error: libllama does not export {symbol} ({name}); this build cannot drive MTP heads")
    fn.argtypes, fn.restype = argtypes, restype
    return fn


class Probe:
    def __init__(self, path: str, n_ctx: int, n_draft: int, threads: int):
        self._quiet = C.llama_log_callback(lambda level, text, data: None)  # kept alive: llama.cpp calls it
        C.llama_log_set(self._quiet, None)
        C.llama_backend_init()
        self.set_nextn = staging("set_embeddings_nextn")
        self.nextn_ith = staging("get_embeddings_nextn_ith")
        params = C.llama_model_default_params()
        params.load_mtp = True
        self.model = C.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            sys.exit(f"error: cannot load {path}")
        self.n_nextn = C.llama_model_n_layer_nextn(self.model)
        if self.n_nextn <= 0:
            sys.exit(f"error: {path} has no MTP layers (llama_model_n_layer_nextn = 0)")
        buf = ctypes.create_string_buffer(64)
        C.llama_model_meta_val_str(self.model, b"general.architecture", buf, 64)
        self.arch = buf.value.decode()
        self.vocab = C.llama_model_get_vocab(self.model)
        self.n_vocab = C.llama_vocab_n_tokens(self.vocab)
        self.n_embd = C.llama_model_n_embd_out(self.model)
        self.n_draft, self.n_ctx, self.threads = n_draft, n_ctx, threads

    def context(self, mtp: bool = False, rollback: int = 0):
        p = C.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch = self.n_ctx, 512, 512
        p.n_threads = p.n_threads_batch = self.threads
        p.n_rs_seq = rollback
        if mtp:
            p.ctx_type = C.LLAMA_CONTEXT_TYPE_MTP
        ctx = C.llama_init_from_model(self.model, p)
        if not ctx:
            sys.exit("error: llama.cpp refused the " + ("MTP " if mtp else "") + "context")
        return ctx

    # -- target side --
    def decode(self, ctx, tokens: list[int], pos0: int) -> np.ndarray:
        """Decode tokens at pos0.. on seq 0 with every row's logits; return them [n, n_vocab]."""
        batch = C.llama_batch_init(len(tokens), 0, 1)
        for i, tok in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos0 + i, 1, True
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(tokens)
        try:
            if C.llama_decode(ctx, batch) != 0:
                sys.exit("error: llama_decode failed")
        finally:
            C.llama_batch_free(batch)
        return np.array([np.ctypeslib.as_array(C.llama_get_logits_ith(ctx, i), (self.n_vocab,)) for i in range(len(tokens))])

    def rows(self, ctx, n: int) -> np.ndarray:
        """The nextn hidden rows of the last target batch (one per token)."""
        return np.array([np.ctypeslib.as_array(self.nextn_ith(ctx, i), (self.n_embd,)) for i in range(n)], dtype=np.float32)

    # -- MTP side --
    def mtp(self, ctx, pairs: list[tuple[int, int, np.ndarray]], want_last: bool):
        """Run the MTP block on (token, pos, hidden row) pairs; return (logits, nextn row) of the last."""
        batch = C.llama_batch_ext_init(ctx)
        keep = []
        try:
            for i, (tok, pos, row) in enumerate(pairs):
                idx = C.llama_batch_ext_add_token(batch, 0, tok)
                position = (C.llama_pos * 4)(pos, 0, 0, 0)
                data = np.ascontiguousarray(row, dtype=np.float32)
                keep += [position, data]
                C.llama_batch_ext_set_pos(batch, idx, position)
                C.llama_batch_ext_set_embd_token(batch, idx, C.llama_embd(data.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, self.n_embd))
                if want_last and i == len(pairs) - 1:
                    C.llama_batch_ext_set_output_logits(batch, idx, True)
            if C.llama_process(ctx, C.LLAMA_PROCESS_TYPE_DECODE, batch) != 0:
                sys.exit("error: llama_process on the MTP context failed")
            if not want_last:
                return None, None
            last = len(pairs) - 1
            logits = np.ctypeslib.as_array(C.llama_get_logits_ith(ctx, last), (self.n_vocab,)).copy()
            row = np.ctypeslib.as_array(self.nextn_ith(ctx, last), (self.n_embd,)).copy()
            return logits, row
        finally:
            C.llama_batch_ext_free(batch)

    # -- the two decoders --
    def plain(self, prompt: list[int], n: int) -> list[int]:
        ctx = self.context()
        out, pos, tokens = [], 0, prompt
        while len(out) < n:
            token = int(np.argmax(self.decode(ctx, tokens, pos)[-1]))
            out.append(token)
            pos, tokens = pos + len(tokens), [token]
        C.llama_free(ctx)
        return out

    def speculative(self, prompt: list[int], n: int) -> tuple[list[int], int, int, float]:
        hybrid = self.arch in HYBRID_ROLLBACK
        tgt = self.context(rollback=self.n_draft + 1 if hybrid else 0)
        self.set_nextn(tgt, True, False)
        dft = self.context(mtp=True)
        self.set_nextn(dft, True, True)
        t0 = time.perf_counter()
        logits = self.decode(tgt, prompt, 0)
        h = self.rows(tgt, len(prompt))
        zero = np.zeros(self.n_embd, dtype=np.float32)
        # Catch-up: token k sits at pos k with the target's row of pos k - 1.
        self.mtp(dft, [(tok, k, h[k - 1] if k else zero) for k, tok in enumerate(prompt)], want_last=False)
        pending, h_prev, pos = int(np.argmax(logits[-1])), h[-1], len(prompt)
        out, drafted, accepted = [pending], 0, 0
        while len(out) < n:
            drafts, tok, row = [], pending, h_prev
            for i in range(self.n_draft):  # a chain: (x_p, h_{p-1}) predicts x_{p+1}
                step_logits, row = self.mtp(dft, [(tok, pos + i, row)], want_last=True)
                tok = int(np.argmax(step_logits))
                drafts.append(tok)
            logits = self.decode(tgt, [pending] + drafts, pos)
            rows = self.rows(tgt, len(drafts) + 1)
            greedy = [int(np.argmax(row_logits)) for row_logits in logits]
            j = 0
            while j < len(drafts) and drafts[j] == greedy[j]:
                j += 1
            drafted, accepted = drafted + len(drafts), accepted + j
            mem_t, mem_d = C.llama_get_memory(tgt), C.llama_get_memory(dft)
            if not C.llama_memory_seq_rm(mem_t, 0, pos + j + 1, -1):
                sys.exit("error: the target could not drop the rejected drafts")
            C.llama_memory_seq_rm(mem_d, 0, pos, -1)  # the MTP block is attention: plain KV cells
            kept = [pending] + drafts[:j]
            pairs = [(t, pos + i, h_prev if i == 0 else rows[i - 1]) for i, t in enumerate(kept)]
            self.mtp(dft, pairs, want_last=False)
            out += drafts[:j] + [greedy[j]]
            pending, h_prev, pos = greedy[j], rows[j], pos + j + 1
        seconds = time.perf_counter() - t0
        C.llama_free(dft)
        C.llama_free(tgt)
        return out[:n], drafted, accepted, seconds

    def tokenize(self, text: str) -> list[int]:
        raw = text.encode()
        buf = (C.llama_token * (len(raw) + 8))()
        n = C.llama_tokenize(self.vocab, raw, len(raw), buf, len(buf), True, True)
        return list(buf[:n])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a GGUF with MTP layers")
    parser.add_argument("--prompt", default="<|im_start|>user\nList the planets of the solar system in order.<|im_end|>\n<|im_start|>assistant\n")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--draft", type=int, default=3, help="MTP chain length per step")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    probe = Probe(args.model, n_ctx=512, n_draft=args.draft, threads=args.threads)
    prompt = probe.tokenize(args.prompt)
    reference = probe.plain(prompt, args.tokens)
    out, drafted, accepted, seconds = probe.speculative(prompt, args.tokens)
    print(f"architecture {probe.arch}, {probe.n_nextn} MTP layer(s), n_embd {probe.n_embd}")
    print(f"MTP chain of {args.draft}: {accepted}/{drafted} drafts accepted "
          f"({accepted / max(drafted, 1):.0%}), {len(out)} tokens in {seconds:.2f} s")
    print("identical to plain greedy decoding:", out == reference)
    if out != reference:
        first = next(i for i, (a, b) in enumerate(zip(out, reference)) if a != b)
        print(f"first difference at token {first}: {out[first]} vs {reference[first]}")
        sys.exit(1)


if __name__ == "__main__":
    main()
