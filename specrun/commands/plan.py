"""`specrun plan`: what a run would load, where, and why, without loading any weights."""

from __future__ import annotations

import json

from specrun import engine, ui
from specrun.core.sampling import near_tie_nats
from specrun.engine import DeviceInfo
from specrun.errors import UsageError
from specrun.files import human_size
from specrun.hardware import placement
from specrun.runtime.plan import Plan, RunOptions, build_plan

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def plan(opts: RunOptions, as_json: bool, gpus: list[str] | None = None, ram_free: str | None = None) -> Plan:
    """Print the plan for these options (text or JSON on stdout); return it.

    `gpus` ("NAME=FREE[/TOTAL]", e.g. "RTX 4060=8GiB") replace the GPUs llama.cpp sees, and
    `ram_free` the free RAM, so a plan for another machine can be reviewed here.
    """
    devices = [parse_gpu(spec) for spec in gpus] if gpus else None
    ram = parse_bytes(ram_free, "--ram-free") if ram_free else None
    result = build_plan(opts, fetch=False, devices=devices, ram_free_bytes=ram, detailed=True)
    if as_json:
        print(json.dumps({**result.to_dict(), "kernels": kernels(result.target_gpu_layers > 0)}, indent=1))
    else:
        for line in plan_lines(result):
            ui.write_text(line + "\n")
    return result


def plan_lines(plan: Plan) -> list[str]:
    """Return the plan as the lines `specrun plan` prints."""
    data = plan.to_dict()
    target, draft = data["target"], data["draft"]
    placed = plan.placement
    lines = [f"target   {target['name']}  {_where(target['path'])}"]
    lines.append(f"         {_layers_text(target['gpu_layers'], target['layer_slots'], plan)}")
    if plan.mmap is False:
        lines.append("         read into memory, not mapped" + (": its layers in RAM sit in the GPU's pinned memory, "
                     "which big passes copy over faster" if plan.placement.target_cpu_layers and plan.devices else ""))
    measured = f" (measured: {placed.head_why})" if placed.head_why else " (--head here)"
    if plan.head_here:
        lines.append(f"         output layer here{measured}: a pass's hidden states cross the network, not its rows of logits")
    elif placement.head_worker(placed, plan.devices):
        lines.append("         output layer on a worker: a row of logits crosses the network for every token a pass verifies"
                     + (f" (measured: {placed.head_why}; --head here computes it here)" if placed.head_why else
                        " (--head here computes it here: for links slower than gigabit, docs/rpc.md)"))
    if draft is not None:
        lines.append(f"draft    {draft['name']}  {_where(draft['path'])}")
        lines.append(f"         {'whole on ' + draft['device'] if draft['gpu_layers'] else 'in RAM'}")
    if plan.tree is None:
        lines.append(f"decoding plain (no draft loaded): {plan.why}")
    else:
        lines.append(f"drafter  {plan.drafter}: {plan.tree.describe()}")
        lines.append(f"         why: {plan.why}")
    if plan.check is not None:
        lines.append(f"         check: {plan.check.describe()}")
    tctx = plan.target_ctx
    lines.append(
        f"context  {tctx.n_ctx} tokens ({plan.ctx_why}); target batch = ubatch {tctx.n_ubatch}"
        + (f" (largest tree {plan.tree.verified.budget} + root), {tctx.n_seq_max} sequences" if plan.tree else "")
    )
    if tctx.parallel > 1:
        lines.append(f"         {tctx.parallel} requests at once: {tctx.cells} KV cells ({tctx.n_ctx} each), "
                     f"{_count(tctx.n_seq_max // tctx.parallel, 'sequence')} each"
                     + (" in a KV cache of its own (--kv-split: chains verified)" if tctx.split else "")
                     + ", one target pass for all"
                     + (", one draft pass for all" if plan.draft_ctx is not None else "")
                     + (", an MTP sequence each" if plan.tree is not None and plan.tree.drafting.loads_mtp else ""))
    if plan.attention_why:
        lines.append(f"         target {plan.attention_why}")
    elif tctx.flash_attn is not None:
        lines.append(f"         target flash attention {tctx.flash_attn} (--flash-attn)")
    if tctx.kv_type is not None:
        lines.append(f"         target KV cache {tctx.kv_type} (--kv-type)")
    if plan.draft_ctx is not None:
        lines.append(f"         draft batch {plan.draft_ctx.n_batch}, {plan.draft_ctx.n_seq_max} sequences")
    lines.append(f"threads  {plan.threads}")
    lines.append(f"kernels  {kernels(target['gpu_layers'] > 0)['text']}")
    parts = {place.name: _parts(place) for place in placed.breakdown}
    lines.append(f"memory   RAM: {human_size(placed.ram_bytes)} planned, {human_size(placed.ram_limit_bytes)} usable"
                 + ("" if placed.ram_fits else "  (does not fit)") + parts.get("RAM", ""))
    for device in data["memory"]["devices"]:
        fits = device["planned_bytes"] <= device["limit_bytes"]
        where = f" on {device['host']}" if device["host"] else ""
        lines.append(
            f"         {device['name']}{where}: {device['layers']} layer slots, {human_size(device['planned_bytes'])} "
            f"planned of {human_size(device['free_bytes'])} free ({human_size(device['limit_bytes'])} usable)"
            + ("" if fits else "  (does not fit)") + parts.get(device["name"], "")
        )
    lines.append("         " + ("context and compute figures from llama.cpp's own simulation of this load"
                              if placed.measured else "context and compute figures estimated from the models' shapes"))
    if not plan.devices:
        lines.append("         no GPU: everything runs on the CPU")
    if plan.round_trips:
        trips = ", ".join(f"{host} {seconds * 1e3:.2f} ms" for host, seconds in plan.round_trips)
        lines.append(f"network  {plan.network_s * 1e3:.2f} ms a target pass on the network: a round trip to each "
                     f"worker holding layers (measured round trips: {trips})")
    for warning in data["warnings"]:
        lines.append(f"warning  {warning}")
    return lines


def kernels(offloaded: bool = False) -> dict:
    """Whether the loaded llama.cpp build's CPU kernels round a token alike in every pass size
    (engine.cpu_kernels_batch_invariant), as `plan` and `bench --report` say it; with `offloaded`
    (target layers on a GPU or an RPC worker) what those devices' kernels do, and the near-tie
    threshold the answers are judged by there."""
    invariant = engine.cpu_kernels_batch_invariant()
    text = ("CPU: one kernel for every pass size (a build without llamafile): specrun keeps flash attention off "
            "and weights unrepacked, so a chain verifies bit for bit as plain decoding and --reproducible keeps "
            "greedy chains (docs/exactness.md)" if invariant else
            "CPU: llamafile's tinyBLAS from two tokens a pass, so multi-token passes round unlike one-token ones; "
            "a build with CMAKE_ARGS=\"-DGGML_LLAMAFILE=OFF\" keeps one kernel for every size (docs/exactness.md)")
    if offloaded:  # measured on CUDA (docs/exactness.md, "On a GPU (CUDA), measured")
        text = ("GPU or worker: passes of two tokens or more round unlike one-token passes (CUDA), so a greedy "
                f"tree may part from plain decoding at a near-tie (under {near_tie_nats(True)} nats there; "
                "--reproducible decodes in one-token passes); " + text)
    return {"cpu_batch_invariant": invariant, "offloaded": offloaded, "near_tie_nats": near_tie_nats(offloaded),
            "text": text}


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _parts(place) -> str:
    """Return '  (model X, context Y, compute Z, output W)' for a place's planned bytes."""
    kinds = (("model", place.model), ("context", place.context), ("compute", place.compute), ("output", place.output))
    shown = [f"{name} {human_size(size)}" for name, size in kinds if size]
    return f"  ({', '.join(shown)})" if shown else ""


def _where(path: str | None) -> str:
    return path if path is not None else "(not downloaded yet)"


def _layers_text(gpu_layers: int, slots: int, plan: Plan) -> str:
    where = "the GPU" if not plan.round_trips else "the RPC workers" if all(d.host for d in plan.devices) else \
        "the RPC workers and GPUs"
    if not plan.devices or gpu_layers == 0:
        return f"all {slots} layer slots in RAM"
    if experts := plan.placement.cpu_expert_layers:
        return (f"all {slots} layer slots on the GPU but the routed experts of the first {experts} "
                f"of {slots - 1} layers, kept in RAM")
    if gpu_layers >= slots:
        return f"all {slots} layer slots on {where}"
    return f"{gpu_layers} of {slots} layer slots on {where}, {slots - gpu_layers} in RAM"


def parse_gpu(spec: str) -> DeviceInfo:
    """Return a made-up GPU from "NAME=FREE[/TOTAL]" (sizes like 8GiB, 7.5G, 8000MB)."""
    name, sep, sizes = spec.rpartition("=")
    if not sep or not name.strip():
        raise UsageError(f"--gpu {spec!r}: expected NAME=FREE or NAME=FREE/TOTAL, e.g. 'RTX 4060=8GiB'")
    free_text, _, total_text = sizes.partition("/")
    free = parse_bytes(free_text, "--gpu")
    total = parse_bytes(total_text, "--gpu") if total_text else free
    if total < free:
        raise UsageError(f"--gpu {spec!r}: free memory exceeds the total")
    return DeviceInfo(name.strip(), "assumed with --gpu", "gpu", "assumed", free, total)


def parse_bytes(text: str, option: str) -> int:
    """Return a size like '8GiB', '7.5G', '512MB' or '1000000' in bytes."""
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value < 0:
        raise UsageError(f"{option}: cannot read the size {text!r} (use e.g. 8GiB, 7.5G, 512MB)")
    return int(value * _UNITS[unit])
