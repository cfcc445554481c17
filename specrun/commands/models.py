"""`specrun pull` and `specrun models`."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from specrun import ui
from specrun.decoding.memory import saved_memories
from specrun.errors import SpecrunError
from specrun.files import human_size
from specrun.models import hub, registry
from specrun.runtime.plan import RunOptions, build_plan

log = logging.getLogger("specrun")


def pull(names: list[str], quiet: bool = False, force: bool = False) -> list[Path]:
    """Fetch (or build) each named model, saying what and how big; print each local path on stdout.

    force: fetch again even what is present; the old file is replaced only once the new copy is
    complete and verified.
    """
    specs = [registry.resolve(name) for name in names]  # a typo fails before any download
    paths = []
    for spec in specs:
        missing = hub.describe_missing(spec)
        if force:
            ui.info(f"pulling {spec.name} again from {spec.sources[0].describe()}...")
        elif missing:
            ui.info(f"pulling {missing}...")
            if (too_big := fit_warning(spec)) is not None:
                ui.warn(too_big)
        else:
            ui.dim(f"{spec.name} is already here")
        path = Path(hub.ensure_local(spec, progress=not quiet, console=ui.err_console(), force=force))
        print(path, flush=True)
        paths.append(path)
    return paths


def fit_warning(spec: registry.ModelSpec) -> str | None:
    """Return one line when the model will not fit this machine at its smallest default context
    (planned from its header before the download), else None; None too where it cannot be planned."""
    try:
        plan = build_plan(RunOptions(target=spec.name, no_spec=True, ctx_size=None, quiet=True), fetch=False)
    except SpecrunError as e:  # no header to be had (offline, not on Hugging Face): download as asked
        log.info("%s: not planned before the download (%s)", spec.name, e)
        return None
    if plan.placement.fits:
        return None
    place = plan.placement
    gpus = sum(place.device_limit_bytes)
    room = f"{human_size(place.ram_limit_bytes)} of free RAM" + (f" and {human_size(gpus)} of GPU memory" if gpus else "")
    return (f"{spec.name} needs about {human_size(place.ram_bytes + sum(place.device_bytes))} with a "
            f"{plan.target_ctx.n_ctx}-token context and this machine has {room}: it would run from disk, very "
            "slowly (`specrun plan --target NAME` shows the plan)").replace("NAME", spec.name)


def list_models(as_json: bool, fit: bool = False) -> None:
    """Print the registry's aliases: a table, or a JSON array; with `fit`, whether and how each
    would run on this machine (planned from its file, or its header alone)."""
    reg = registry.load()
    for error in reg.broken.values():
        ui.warn(f"left out: {error}")
    rows = registry.list_models(reg, hub.is_present)
    fits = {}
    if fit:
        ui.dim(f"planning {len(rows)} models on this machine (a missing model's header is fetched: a few MB)...")
        fits = {row.alias: fit_here(row.alias) for row in rows}
    if as_json:
        print(json.dumps([{**row.as_dict(), **({"fit": fits[row.alias]} if fit else {})} for row in rows],
                         ensure_ascii=False, indent=2))
    else:
        ui.models_table(rows, registry.default_pair(reg), {alias: f["text"] for alias, f in fits.items()})
        for saved in saved_memories():  # (--memory; deleting the file forgets it)
            what = f"{saved['model']}, {saved['answers']} answer(s)" if saved["model"] else "damaged"
            ui.dim(f"memory of answers: {what}, {human_size(saved['bytes'])} ({saved['path']})")


def fit_here(alias: str) -> dict:
    """Return how the model would run here as a target with the default options: context,
    drafter, GPU layers, whether it fits, and a short text; "unknown" with the reason where it
    cannot be planned (neither its file nor its header to be had)."""
    opts = RunOptions(target=alias, ctx_size=None, quiet=True)
    try:
        try:
            plan = build_plan(opts, fetch=False)
        except SpecrunError:  # its draft cannot be planned (not here, no header): lookup drafts
            plan = build_plan(RunOptions(target=alias, draft="lookup", ctx_size=None, quiet=True), fetch=False)
    except SpecrunError as e:
        return {"fits": None, "text": "?", "why": str(e)}
    placed = plan.placement
    where = ("in RAM" if not plan.devices or not placed.target_gpu_layers else
             f"GPU {placed.target_gpu_layers}/{placed.target_n_slots}"
             + (f", experts of {placed.cpu_expert_layers} layers in RAM" if placed.cpu_expert_layers else ""))
    text = f"{plan.target_ctx.n_ctx // 1024}k ctx, {where}, {plan.drafter}" if placed.fits else "no"
    return {"fits": placed.fits, "n_ctx": plan.target_ctx.n_ctx, "drafter": plan.drafter,
            "gpu_layers": placed.target_gpu_layers, "layer_slots": placed.target_n_slots,
            "experts_in_ram_layers": placed.cpu_expert_layers,
            "ram_bytes": placed.ram_bytes, "device_bytes": list(placed.device_bytes), "text": text,
            "why": plan.ctx_why if placed.fits else "; ".join(placed.warnings)}
