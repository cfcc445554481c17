"""Print the memory plan against what llama.cpp allocates, per architecture and component.

For each model (the offline ones and the tiny random models of the tests' layouts), each context
and each way of decoding (plain, lookup trees or chains), the plan is made (llama.cpp's simulated
load, or its cached figures) and the run is loaded for real; the table shows both, in MiB.

    python scripts/memory_table.py                 # markdown table on stdout
    python scripts/memory_table.py --contexts 4096
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from conftest import MODEL_CACHE, OFFLINE_ALIASES  # noqa: E402
from tiny_archs import tiny_arch_model  # noqa: E402

from specrun.models import hub, registry  # noqa: E402
from specrun.runtime.plan import RunOptions, build_plan  # noqa: E402
from specrun.runtime.runtime import Runtime  # noqa: E402

MIB = 1024**2


def models() -> dict[str, Path]:
    found = {arch: Path(hub.ensure_local(registry.resolve(OFFLINE_ALIASES[field]), progress=False))
             for arch, field in (("llama", "smollm2_f32"), ("gemma3", "gemma_q4"))}
    for arch in ("qwen35", "qwen35moe", "lfm2", "gpt-oss", "jamba", "mamba"):
        found[arch] = tiny_arch_model(MODEL_CACHE, arch)
    return found


def row(arch: str, path: Path, n_ctx: int, mode: str) -> str:
    flags = {"plain": {"no_spec": True}, "lookup": {"draft": "lookup"}}[mode]
    plan = build_plan(RunOptions(target=str(path), ctx_size=n_ctx, threads=1, quiet=True, **flags), devices=[])
    with Runtime(plan) as rt:
        got = rt.allocation
    (ram,) = plan.placement.breakdown
    pairs = ((ram.model, got.weights), (ram.context, got.context), (ram.compute, got.compute_total),
             (ram.output, got.output))
    cells = " | ".join(f"{p / MIB:.1f} / {a / MIB:.1f}" for p, a in pairs)
    shape = plan.tree.verify if plan.tree else "plain"
    return f"| {arch} | {n_ctx} | {shape} | {cells} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    args = parser.parse_args()
    print("| architecture | context | decoding | weights | KV + state | compute | output |")
    print("|---|---|---|---|---|---|---|")
    print("| | | | planned / allocated, MiB | | | |")
    for arch, path in models().items():
        for n_ctx in args.contexts:
            for mode in ("plain", "lookup"):
                print(row(arch, path, n_ctx, mode), flush=True)


if __name__ == "__main__":
    main()
