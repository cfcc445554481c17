"""The prompts experiments decode: the built-in workloads (workloads.toml, shipped with the
package: free chat, code edits, rewrites), or a file's (JSONL or one prompt per line)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specrun.errors import UsageError
from specrun.inputs import decode_utf8

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

BUILT_IN = Path(__file__).with_name("workloads.toml")


def _read_built_in() -> tuple[dict[str, str], dict[str, list[str]], int]:
    """Return (pasted texts by name, {workload: prompts with the texts pasted in}, kinds)."""
    data = tomllib.loads(BUILT_IN.read_text(encoding="utf-8"))
    pasted = data["pasted"]
    workloads = {name: [template.format(**pasted) for template in templates]
                 for name, templates in data["workloads"].items()}
    return pasted, workloads, data["kinds"]


PASTED, WORKLOADS, KINDS = _read_built_in()
ROUNDS = len(WORKLOADS["chat"]) // KINDS  # requests of each kind: WORKLOADS[w][i + r * KINDS] is request r of kind i


def workload_prompts(workload: str, path: Path | None) -> dict[str, list[str]]:
    """Return {workload: prompts}: the file's prompts (as one workload, "prompts"), or the built-in
    set named (all of them for "all"): one request of each kind (tune measures the other rounds)."""
    if path is not None:
        return {"prompts": load_prompts(path)}
    if workload == "all":
        return {name: prompts[:KINDS] for name, prompts in WORKLOADS.items()}
    if workload not in WORKLOADS:
        raise UsageError(f"unknown workload {workload!r}: choose chat, code, rewrite or all")
    return {workload: WORKLOADS[workload][:KINDS]}


def load_prompts(path: Path) -> list[str]:
    """Return a file's prompts: JSONL ({"prompt": "..."} per line, for multi-line prompts) or one
    prompt per line."""
    try:
        lines = [line.strip() for line in decode_utf8(path.read_bytes(), f"prompts file {path}").splitlines()]
    except OSError as e:
        raise UsageError(f"cannot read prompts file {path}: {e.strerror}") from None
    lines = [line for line in lines if line]
    if not lines:
        raise UsageError(f"prompts file {path} has no prompts")
    if not lines[0].startswith("{"):
        return lines
    prompts = []
    for number, line in enumerate(lines, start=1):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"prompts file {path}, line {number}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
            raise UsageError(f'prompts file {path}, line {number}: expected {{"prompt": "..."}}')
        prompts.append(obj["prompt"])
    return prompts
