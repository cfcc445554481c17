"""`specrun pull` and `specrun models`."""

from __future__ import annotations

import json
from pathlib import Path

from specrun import ui
from specrun.models import hub, registry


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
        else:
            ui.dim(f"{spec.name} is already here")
        path = Path(hub.ensure_local(spec, progress=not quiet, console=ui.err_console(), force=force))
        print(path, flush=True)
        paths.append(path)
    return paths


def list_models(as_json: bool) -> None:
    """Print the registry's aliases: a table, or a JSON array."""
    reg = registry.load()
    for error in reg.broken.values():
        ui.warn(f"left out: {error}")
    rows = registry.list_models(reg, hub.is_present)
    if as_json:
        print(json.dumps([row.as_dict() for row in rows], ensure_ascii=False, indent=2))
    else:
        ui.models_table(rows, registry.default_pair(reg))
