"""`specrun bench --report`: one shareable table of this machine and this pair.

What users post when they compare setups: the devices and their memory, the llama.cpp build
(backends, CPU flags), where the layers went, the target's and the draft's cost per forward pass
for n = 1, 2, 4, ... tokens up to the largest tree the plan allows (both sides of every step that
the placement makes in t(n)), where the target's attention runs on this CPU its passes after a long
context with flash attention and without (tuning.attention), plain speed, the speed of what runs by
default and of each drafter per workload, and the tree `specrun tune` would choose from these very
measurements.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import replace
from pathlib import Path

from specrun import engine, ui
from specrun.core.tree_shapes import MAX_BUDGET, TreeShape
from specrun.experiments import speedups
from specrun.files import human_size
from specrun.hardware.machine import probe_hardware
from specrun.runtime.plan import Plan, RunOptions, build_plan
from specrun.runtime.runtime import Runtime
from specrun.tuning import attention
from specrun.tuning import cost_model as tuner
from specrun.tuning import profiles
from specrun.tuning import report as tuning_report
from specrun.tuning.pair import Measured, PairSettings, choose, measure_pair

REPORT_FORMAT = 1
# The workload row that stands for what a run with the same options uses, by the plan's drafter.
DEFAULT_MODES = {"hybrid": "hybrid", "lookup": "lookup", "draft model": "draft tree", "sequoia": "draft tree",
                 "mtp": "mtp", "none": "plain"}


# How hard the report measures: the largest tree whose cost is measured (root added), curve
# repeats, the calibration and the time given each.
REPORT = PairSettings(max_budget=512, depth=12, width=4, top_k=4, curve_repeats=3, curve_seconds=120.0,
                      calibration_prompts=3, calibration_tokens=48, calibration_seconds=120.0)


def bench_report(opts: RunOptions, budgets: list[int] | None, workload: str, prompts_file: Path | None,
                 max_tokens: int, as_json: bool) -> dict:
    """Measure everything the report holds (cost curves up to the largest of `budgets`, the
    calibration as long as the answers); print it as Markdown (or JSON) on stdout; return it."""
    settings = replace(REPORT, calibration_tokens=max(16, max_tokens), max_budget=max(budgets or [REPORT.max_budget]))
    report = measure_report(opts, settings, workload, prompts_file, max_tokens)
    if as_json:
        print(json.dumps(report, indent=1))
    else:
        ui.write_text(markdown(report))
    return report


def measure_report(opts: RunOptions, settings: PairSettings, workload: str, prompts_file: Path | None,
                   max_tokens: int) -> dict:
    """Return the report as a dict (see `markdown` for what each part means)."""
    hardware = probe_hardware()
    budget = max(1, min(settings.max_budget, MAX_BUDGET, opts.ctx_size - 1))
    shape = TreeShape(budget, min(settings.depth, budget), min(settings.width, budget), min(settings.top_k, budget))
    with Runtime(replace(opts, lookup=False), shape_override=shape) as rt:
        plan = rt.plan
        ui.dim(f"report: measuring cost curves up to {budget + 1} tokens")
        with tuning_report.progress() as progress:
            measured = measure_pair(rt, settings, shape, progress, whole_curve=True)
        choice, best_tree = choose(measured)
        passes_by_attention = attention.attention_here(rt, opts)
    ui.dim("report: measuring the drafters per workload")
    tuning_report.warn_if_busy(engine.default_threads(), "speedups measured now may not hold on a quiet machine")
    rows = speedups.by_workload(opts, workload, prompts_file, max_tokens)
    default = build_plan(opts)  # what a run with these options uses
    return {
        "format": REPORT_FORMAT,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": _machine(hardware),
        "build": {"llama": engine.llama_version_info(), "backends": list(hardware.backends),
                  "cpu_features": hardware.cpu_features,
                  "cpu_batch_invariant": engine.cpu_kernels_batch_invariant()},
        "pair": {"target": plan.files.target_name, "draft": plan.files.draft_name,
                 "target_file": str(plan.files.target_path), "draft_file": str(plan.files.draft_path)},
        "placement": _placement(plan, opts),
        "cost": {
            "target_s": {str(n): s for n, s in sorted(measured.target.decode.items())},
            "draft_s": {str(n): s for n, s in sorted(measured.draft.decode.items())},
            "steps": list(measured.target.steps),
            "largest_tree_under_2x": largest_under(measured.target.decode, 2.0),
        },
        "attention": passes_by_attention.to_dict() if passes_by_attention else None,
        "plain": {"tokens_per_s": round(1.0 / (measured.plain.target_s + measured.plain.overhead_s), 2)
                  if measured.plain.target_s else 0.0},
        "calibration": {**measured.calibration.summary(), "tau_by_budget": _tau(measured)},
        "tune_choice": {**choice.to_dict(), "text": _choice_text(choice)},
        "best_tree": {**best_tree.to_dict(), "text": _choice_text(best_tree)},
        "stored_profile_choice": stored_choice(opts, default),
        "default_mode": DEFAULT_MODES[default.drafter],
        "workloads": rows,
    }


def _tau(measured: Measured) -> dict[str, float]:
    """Return the accepted draft tokens per pass for trees of n - 1 draft tokens, n the curve's sizes:
    with the cost curve, the speedup any tree size would give (see `predicted_speedup`)."""
    cal = measured.calibration
    budgets = sorted({n - 1 for n in measured.target.decode if 2 <= n <= cal.budget + 1})
    return {str(b): round(t, 4) for b, t in cal.tau(budgets).items()} if cal.steps else {}


def predicted_speedup(target_s: dict[str, float], tau_by_budget: dict[str, float]) -> tuple[int, float]:
    """Return (budget, speedup) of the best tree from a cost curve and an acceptance curve (possibly
    measured on other machines): (tau(B) + 1) tokens per pass of B + 1 tokens against one token
    per one-token pass. The draft's own time is left out: an upper bound where drafting is cheap."""
    one = target_s.get("1")
    best = (0, 1.0)
    for budget, tau in tau_by_budget.items():
        cost = target_s.get(str(int(budget) + 1))
        if one and cost:
            best = max(best, (int(budget), one * (tau + 1) / cost), key=lambda b: b[1])
    return best


def largest_under(target_s: dict[int, float], ratio: float) -> int:
    """Return the largest measured batch whose pass costs under `ratio` x a one-token pass."""
    one = target_s.get(1)
    if not one:
        return 0
    return max((n for n, s in target_s.items() if s < ratio * one), default=1)


def _machine(hardware) -> dict:
    return {
        "cpu": hardware.cpu, "cores": hardware.cores,
        "ram_total_bytes": hardware.ram_total_bytes, "ram_available_bytes": hardware.ram_available_bytes,
        "devices": [{k: d[k] for k in ("name", "description", "kind", "backend", "free_bytes", "total_bytes")}
                    for d in hardware.devices],
        "os": platform.platform(),
    }


def _placement(plan: Plan, opts: RunOptions) -> dict:
    placed = plan.placement
    return {
        "gpu_memory_limit_bytes": opts.gpu_memory,
        "target_gpu_layers": placed.target_gpu_layers,
        "target_layer_slots": placed.target_n_slots,
        "draft_on": (plan.devices[placed.draft_device].name if placed.draft_device is not None else "RAM")
        if plan.draft_loaded else None,
        "op_offload": placed.op_offload,
        "target_mapped": plan.mmap is not False,  # False: read into memory (pinned where layers stay in RAM)
        "planned_device_bytes": list(placed.device_bytes),
        "planned_ram_bytes": placed.ram_bytes,
        "n_ubatch": plan.target_ctx.n_ubatch,
        "threads": plan.threads,
        "target_flash_attn": plan.target_ctx.flash_attn or engine.default_flash_attn(plan.target_ctx.kv_type),  # as asked (auto: llama.cpp's)
        "target_kv_type": plan.target_ctx.kv_type or engine.DEFAULT_KV_TYPE,
    }


def _choice_text(choice: tuner.Choice) -> str:
    if choice.kind == "plain":
        return "plain decoding"
    what = {"sequoia": "Sequoia tree", "specexec": "best-first tree"}.get(choice.kind, choice.kind)
    return (f"{what} of {choice.budget} tokens, depth {choice.depth}: predicted {choice.predicted_tokens_per_s:.1f} "
            f"tok/s, x{choice.predicted_speedup:.2f}")


# --------------------------------------------------------------------------------------------
# Markdown


def markdown(report: dict) -> str:
    """Return the report as one Markdown document: a few small tables, ready to paste."""
    m, b, pair, p, cost = report["machine"], report["build"], report["pair"], report["placement"], report["cost"]
    lines = [f"## specrun bench report ({report['date']})", "", "| | |", "|---|---|"]
    lines.append(f"| CPU | {m['cpu']}, {m['cores']} threads |")
    lines.append(f"| RAM | {human_size(m['ram_total_bytes'])} ({human_size(m['ram_available_bytes'])} available) |")
    for d in m["devices"]:
        if d["kind"] != "cpu":
            lines.append(f"| {d['kind'].upper()} | {d['description'] or d['name']}: {human_size(d['total_bytes'])} "
                         f"({human_size(d['free_bytes'])} free) |")
    lines.append(f"| build | {b['llama']}; backends {', '.join(b['backends']) or '?'} |")
    lines.append(f"| CPU flags | {_flags(b['cpu_features'])} |")
    if "cpu_batch_invariant" in b:  # reports from before it was measured lack it
        lines.append("| CPU kernels | " + ("one for every pass size (no llamafile)" if b["cpu_batch_invariant"]
                                          else "llamafile's tinyBLAS from two tokens a pass") + " |")
    lines.append(f"| target | {pair['target']} |")
    lines.append(f"| draft | {pair['draft']} |")
    limit = f" (GPU limited to {human_size(p['gpu_memory_limit_bytes'])})" if p["gpu_memory_limit_bytes"] else ""
    if p["target_layer_slots"]:
        lines.append(f"| layers | target {p['target_gpu_layers']} of {p['target_layer_slots']} slots on GPU{limit}; "
                     f"draft {p['draft_on'] or 'not loaded'}; op offload {'on' if p['op_offload'] else 'off'}"
                     f"{'' if p.get('target_mapped', True) else '; target read, not mapped (pinned)'} |")
    else:
        lines.append("| layers | no GPU: target and draft in RAM |")
    if "target_flash_attn" in p:  # reports from before the option lack it
        lines.append(f"| target flash attention | {p['target_flash_attn']} |")
    if "target_kv_type" in p:  # (likewise)
        lines.append(f"| target KV cache | {p['target_kv_type']} |")
    planned = ", ".join(human_size(n) for n in p["planned_device_bytes"]) or "none"
    lines.append(f"| memory planned | GPU {planned}; RAM {human_size(p['planned_ram_bytes'])} |")
    lines += ["", "Cost of one forward pass (ms) by tokens in the batch"
              + (f"; t(n) may step at n = {', '.join(map(str, cost['steps']))}" if cost["steps"] else "") + ":", ""]
    sizes = sorted({int(n) for n in cost["target_s"]} | {int(n) for n in cost["draft_s"]})
    lines.append("| n | " + " | ".join(map(str, sizes)) + " |")
    lines.append("|---|" + "---:|" * len(sizes))
    for label, points in (("target", cost["target_s"]), ("draft", cost["draft_s"])):
        cells = [f"{points[str(n)] * 1000:.2f}" if str(n) in points else "" for n in sizes]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if report.get("attention"):  # (a CPU's attention over an f16 cache; reports from before it lack it)
        lines += _attention_lines(report["attention"])
    lines.append("")
    lines.append(f"Largest batch under 2x a one-token target pass: {cost['largest_tree_under_2x']} tokens. "
                 f"Plain decoding: {report['plain']['tokens_per_s']:.2f} tok/s. "
                 f"Calibration: {report['calibration'].get('accepted_per_pass', 0):.2f} tokens accepted per pass.")
    lines.append(f"`specrun tune` would choose: {report['tune_choice']['text']}"
                 + ("" if report["tune_choice"]["kind"] != "plain" else f" (best tree: {report['best_tree']['text']})")
                 + "."
                 + (f" Stored profile: {report['stored_profile_choice']['kind']}." if report["stored_profile_choice"] else ""))
    lines += ["", "| workload | mode | tok/s | x plain | accepted/pass | same output |", "|---|---|---:|---:|---:|---|"]
    for row in report["workloads"]:
        mode = row["mode"] + (" (default)" if row["mode"] == report["default_mode"] else "")
        lines.append(f"| {row['workload']} | {mode} | {row['tokens_per_s']:.2f} | {row['ratio_to_plain']:.2f} | "
                     f"{row['accepted_per_pass']:.2f} | {'yes' if row['identical_output'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def _attention_lines(found: dict) -> list[str]:
    """The target's passes with and without flash attention (ms) and what to make of them."""
    sizes = list(found["with_s"])
    lines = ["", f"The target's passes after {found['cells']} tokens of context (ms), and its prompts (tokens/s):", "",
             "| flash attention | " + " | ".join(f"{n} token{'s' if n != '1' else ''}" for n in sizes) + " | prompt |",
             "|---|" + "---:|" * (len(sizes) + 1)]
    for label, key in (("with (llama.cpp's auto)", "with"), ("without (`--flash-attn off`)", "without")):
        cells = " | ".join(f"{found[key + '_s'][n] * 1000:.1f}" for n in sizes)
        lines.append(f"| {label} | {cells} | {found['prompt_tokens_per_s'][key]:.0f} |")
    if found.get("beside"):  # (the same passes beside other requests' texts: reports from before lack them)
        beside = found["beside"]
        for label, key in (("with", "with_s"), ("without", "without_s")):
            cells = " | ".join(f"{beside[key][n] * 1000:.1f}" for n in sizes)
            others = f"{beside['requests']} other request{'s' if beside['requests'] != 1 else ''}"
            lines.append(f"| {label}, beside {others} as long | {cells} | |")
    return lines + ["", found["advice"][0].upper() + found["advice"][1:] + "."]


def _flags(features: str) -> str:
    """Return the CPU features llama.cpp reports as on ('AVX2 = 1 | ...' -> 'AVX2 ...')."""
    on = [part.split("=")[0].split(":")[-1].strip() for part in features.split("|") if part.strip().endswith("= 1")]
    return " ".join(on) or features or "?"


def stored_choice(opts: RunOptions, plan: Plan) -> dict | None:
    """Return the stored tuning profile's choice for the plan's pair, or None."""
    files = plan.files
    if files.draft_path is None:
        return None
    profile = profiles.load(files.target_path, files.draft_path, **opts.profile_options())
    return profile.get("config") if profile else None
