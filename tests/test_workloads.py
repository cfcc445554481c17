"""The built-in workloads: their prompts are data shipped with the package, the same prompts in
the same order as every figure measured on them so far."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from specrun.experiments.workloads import KINDS, ROUNDS, WORKLOADS

ROOT = Path(__file__).resolve().parent.parent

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


def test_the_built_in_prompts_are_those_every_figure_was_measured_on():
    """bench's tables, tune's per-workload predictions and the figures in docs/ decoded exactly
    these prompts in this order: another prompt or order makes them incomparable."""
    assert list(WORKLOADS) == ["chat", "code", "rewrite"] and (KINDS, ROUNDS) == (4, 8)
    digest = hashlib.sha256(json.dumps(WORKLOADS).encode()).hexdigest()[:16]
    assert digest == "56ab4d4cd26be636"


def test_every_data_file_of_the_package_is_installed_with_it():
    """A data file left out of package-data is missing from the wheel: `specrun bench` would fail
    on every installed copy, though it works from a checkout."""
    shipped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    data = {path for path in (ROOT / "specrun").rglob("*") if path.is_file() and path.suffix not in (".py", ".pyc")}
    listed = {ROOT / package.replace(".", "/") / name for package, names in shipped.items() for name in names}
    assert data == listed
