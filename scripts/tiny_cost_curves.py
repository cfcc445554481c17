"""Target seconds per pass over n tokens (one sequence, all rows' logits) on the tiny random models of
tests/tiny_archs.py and a dense llama with the same vocabulary; sizes and models interleaved.
Usage: PYTHONPATH=. python scripts/tiny_cost_curves.py"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, "tests")
from specrun import engine
from specrun.engine import Batch
from pinned_sources import vocab_gguf
from specrun.models.synthetic import write_random_model
dense = Path(tempfile.gettempdir()) / "specrun-tiny-llama-qwen35-vocab.gguf"
if not dense.exists():
    write_random_model(vocab_gguf("qwen35"), dense, seed=1, n_layer=4, n_embd=64, n_head=4, n_head_kv=2, n_ff=128)
root = Path.home() / ".cache/specrun/tiny-arch"
models = {"llama (dense, F32)": dense, "qwen35 (hybrid)": root / "qwen35-seed1-v1.gguf",
          "qwen35moe (hybrid MoE)": root / "qwen35moe-seed1-v1.gguf", "gpt-oss (MoE)": root / "gpt-oss-seed1-v1.gguf"}
sizes = [1, 2, 4, 8, 16, 64]
ctxs = {}
for name, p in models.items():
    m = engine.Model(p)
    c = engine.Context(m, n_ctx=1024, n_batch=64, n_seq_max=1, n_rs_seq=8, threads=1)
    b = Batch(64, 1); b.set_sequence(list(range(100, 132)), 0, 0, "none"); c.decode(b)
    ctxs[name] = (m, c, b)
times = {(name, n): [] for name in models for n in sizes}
for rep in range(7):
    for n in sizes:
        for name, (m, c, b) in ctxs.items():
            pos = c.seq_pos_max(0) + 1
            b.set_sequence(list(range(200, 200 + n)), pos, 0, "all")
            t = time.perf_counter(); c.decode(b); times[(name, n)].append(time.perf_counter() - t)
for name in models:
    t1 = statistics.median(times[(name, 1)])
    row = [statistics.median(times[(name, n)]) for n in sizes]
    print(f"{name:24s} " + "  ".join(f"t({n})={t*1000:6.2f}ms ({t/t1:4.2f}x, {t/n*1000:5.2f}/tok)" for n, t in zip(sizes, row)))
