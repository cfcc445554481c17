"""Which verify shapes stay exact on a hybrid target (tiny random models from tests/tiny_archs.py): independent
chains (one sequence each) and shared-prefix trees, scored and then rolled back. Usage:
    PYTHONPATH=. python scripts/hybrid_shapes_probe.py qwen35
Prints the max abs logit difference against a fresh single-sequence decode (0.0 = exact)."""
import sys
import numpy as np
from pathlib import Path
from specrun import engine
from specrun.engine import Batch

arch = sys.argv[1] if len(sys.argv) > 1 else "qwen35"
p = Path.home() / f".cache/specrun/tiny-arch/{arch}-seed1-v1.gguf"
m = engine.Model(p)
prompt = m.tokenize("The cat sat on the mat. The dog")
rng = np.random.default_rng(0)

def ctx(k):
    return engine.Context(m, n_ctx=512, n_batch=128, n_seq_max=k, n_rs_seq=8, threads=1)

def ref_logits(tokens):
    """Logits after each of `tokens` decoded in one sequence, one batch, fresh context."""
    c = ctx(1); b = Batch(128, 1)
    b.set_sequence(list(tokens), 0, 0, "all"); c.decode(b)
    out = c.logits().copy(); c.close(); return out

def prefill(c, n_seq):
    b = Batch(128, 1); b.set_sequence(prompt[:-1], 0, 0, "none"); c.decode(b)
    for s in range(1, n_seq):
        c.seq_cp(0, s, -1, -1)

root = prompt[-1]; p0 = len(prompt) - 1
K, L = 3, 4
chains = [list(rng.integers(0, 1000, L)) for _ in range(K)]

def chains_context():
    """Return a context whose sequences 0..K-1 hold the prompt and have scored one chain each."""
    c = ctx(K); prefill(c, K)
    b = Batch(128, K)
    for s, ch in enumerate(chains):
        for j, t in enumerate([root] + ch):
            b.add(int(t), p0 + j, [s], True)
    c.decode(b)
    return c

# A: K independent chains, one seq each, root duplicated, equal lengths.
c = ctx(K); prefill(c, K)
b = Batch(128, K)
for s, ch in enumerate(chains):
    for j, t in enumerate([root] + ch):
        b.add(int(t), p0 + j, [s], True)
try:
    c.decode(b)
    got = c.logits().copy()
    errs = []
    for s, ch in enumerate(chains):
        ref = ref_logits(prompt + ch)[len(prompt) - 1:]
        errs.append(float(np.abs(got[s * (L + 1):(s + 1) * (L + 1)] - ref).max()))
    print("A chains logits max diff per chain", errs)
    # roll back chain 1 to accept 2 drafts, make it seq 0, decode the next token, compare
    a = 2
    c.seq_rm(1, p0 + 1 + a, -1)
    c.seq_cp(1, 0, -1, -1)
    c.seq_keep(0)
    nxt = 77
    b1 = Batch(8, 1); b1.set_sequence([nxt], p0 + 1 + a, 0, "last"); c.decode(b1)
    ref = ref_logits(prompt + chains[1][:a] + [nxt])[-1]
    print("A rollback in seq 1 then cp to 0: diff", float(np.abs(c.logits_row(-1) - ref).max()))
except Exception as e:
    print("A failed:", e)
c.close()

# A2: rollback after copying the chosen chain's seq to 0 first
c = chains_context()
a = 1
c.seq_cp(2, 0, -1, -1); c.seq_keep(0); c.seq_rm(0, p0 + 1 + a, -1)
b1 = Batch(8, 1); b1.set_sequence([nxt], p0 + 1 + a, 0, "last"); c.decode(b1)
ref = ref_logits(prompt + chains[2][:a] + [nxt])[-1]
print("A2 cp chain 2 to 0, keep 0, then roll back seq 0: diff", float(np.abs(c.logits_row(-1) - ref).max()))
c.close()

# A3: the accepted chain is seq 0 itself (chains in seqs 0..K-1)
c = chains_context()
a = 2
c.seq_keep(0); c.seq_rm(0, p0 + 1 + a, -1)
b1 = Batch(8, 1); b1.set_sequence([nxt], p0 + 1 + a, 0, "last"); c.decode(b1)
ref = ref_logits(prompt + chains[0][:a] + [nxt])[-1]
print("A3 keep seq 0, roll it back: diff", float(np.abs(c.logits_row(-1) - ref).max()))
c.close()

# B: a tree: shared root carries all seqs, two branches below it.
c = ctx(2); prefill(c, 2)
b = Batch(128, 2)
br = [list(rng.integers(0, 1000, 3)) for _ in range(2)]
b.add(int(root), p0, [0, 1], True)
for s, ch in enumerate(br):
    for j, t in enumerate(ch):
        b.add(int(t), p0 + 1 + j, [s], True)
try:
    c.decode(b)
    got = c.logits().copy()
    ref0 = ref_logits(prompt + br[0])[len(prompt) - 1:]
    ref1 = ref_logits(prompt + br[1])[len(prompt) - 1:]
    print("B tree root diff", float(np.abs(got[0] - ref0[0]).max()),
          "branch0", float(np.abs(got[1:4] - ref0[1:]).max()), "branch1", float(np.abs(got[4:7] - ref1[1:]).max()))
except Exception as e:
    print("B failed:", e)
c.close()

def check_main(label, c, main, kept_tokens, pos):
    b1 = Batch(8, 1); b1.set_sequence([nxt], pos, main, "last"); c.decode(b1)
    ref = ref_logits(prompt + kept_tokens + [nxt])[-1]
    print(label, float(np.abs(c.logits_row(-1) - ref).max()))
    # one more step: the state must keep going right
    b1.set_sequence([5], pos + 1, main, "last"); c.decode(b1)
    ref = ref_logits(prompt + kept_tokens + [nxt, 5])[-1]
    print(label, "next", float(np.abs(c.logits_row(-1) - ref).max()))

# A4: chains; the accepted chain's seq becomes the main sequence (keep it, roll it back)
for acc_seq, a in ((1, 2), (2, 0), (0, 4)):
    c = chains_context()
    c.seq_keep(acc_seq); c.seq_rm(acc_seq, p0 + 1 + a, -1)
    check_main(f"A4 chains: keep seq {acc_seq}, roll back to {a} drafts, go on in it:", c, acc_seq, chains[acc_seq][:a], p0 + 1 + a)
    c.close()

# B2: tree with shared root; accept in a branch: keep its seq, roll back, go on in it
for acc_seq, a in ((1, 1), (0, 2), (1, 0)):
    c = ctx(2); prefill(c, 2)
    b = Batch(128, 2)
    b.add(int(root), p0, [0, 1], True)
    for s, ch in enumerate(br):
        for j, t in enumerate(ch):
            b.add(int(t), p0 + 1 + j, [s], True)
    c.decode(b)
    c.seq_keep(acc_seq); c.seq_rm(acc_seq, p0 + 1 + a, -1)
    check_main(f"B2 tree: keep seq {acc_seq}, roll back to {a} drafts:", c, acc_seq, br[acc_seq][:a], p0 + 1 + a)
    c.close()

# B3: deeper shared prefix: root + 2 shared tokens, then 2 branches of 2
shared = list(rng.integers(0, 1000, 2))
c = ctx(2); prefill(c, 2)
b = Batch(128, 2)
for j, t in enumerate([root] + shared):
    b.add(int(t), p0 + j, [0, 1], True)
br2 = [list(rng.integers(0, 1000, 2)) for _ in range(2)]
for s, ch in enumerate(br2):
    for j, t in enumerate(ch):
        b.add(int(t), p0 + 3 + j, [s], True)
try:
    c.decode(b); got = c.logits().copy()
    r0 = ref_logits(prompt + shared + br2[0])[len(prompt) - 1:]; r1 = ref_logits(prompt + shared + br2[1])[len(prompt) - 1:]
    print("B3 deep tree diffs", float(np.abs(got[:5] - r0).max()), float(np.abs(got[5:7] - r1[3:]).max()))
    c.seq_keep(1); c.seq_rm(1, p0 + 1 + 3, -1)
    check_main("B3 keep seq 1, roll back to 3 drafts:", c, 1, shared + br2[1][:1], p0 + 4)
except Exception as e:
    print("B3 failed", e)
c.close()
