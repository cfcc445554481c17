"""The package keeps the layers docs/layers.md describes: imports point down, no cycles, short
modules, imports at the top (cli.py excepted, for a fast --help)."""

from __future__ import annotations

import ast
import pickle
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "specrun"
DOC = PACKAGE.parent / "docs" / "layers.md"
MAX_LINES = 600


def _modules() -> dict[str, ast.Module]:
    files = sorted(PACKAGE.rglob("*.py"))
    try:
        return {str(f.relative_to(PACKAGE)): ast.parse(f.read_text()) for f in files}
    except SystemError:
        # CPython 3.11.7's "AST constructor recursion depth mismatch": after some deep recursion
        # earlier in the same process (a few of the suite's modules, run before this one), ast.parse
        # fails on any file. A fresh interpreter parses them.
        script = ("import ast, pickle, sys; sys.stdout.buffer.write(pickle.dumps("
                  "[ast.parse(open(f, encoding='utf-8').read()) for f in sys.argv[1:]]))")
        done = subprocess.run([sys.executable, "-c", script, *map(str, files)], capture_output=True, check=True)
        return {str(f.relative_to(PACKAGE)): tree for f, tree in zip(files, pickle.loads(done.stdout))}


def _floors() -> dict[str, int]:
    """Return {room: floor} read from the table in docs/layers.md."""
    floors = {}
    for floor, rooms in re.findall(r"^\| (\d+) \| ([^|]+) \|", DOC.read_text(), flags=re.M):
        for room in re.findall(r"`([\w.]+)/?`", rooms):
            floors[room.removesuffix(".py")] = int(floor)
    return floors


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _internal_imports(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specrun"):
            if node.module == "specrun":
                yield node, [f"specrun.{a.name}" for a in node.names]
            else:
                yield node, [node.module]


def test_every_import_points_down_the_documented_floors():
    floors = _floors() | {"__init__": 0, "__main__": 9}
    upward = []
    for path, tree in _modules().items():
        me = path.split("/")[0].removesuffix(".py")
        assert me in floors, f"{path} is in no floor of docs/layers.md"
        for _, targets in _internal_imports(tree):
            for target in targets:
                room = _room(target)
                if room in floors and floors[room] > floors[me]:
                    upward.append(f"{path} imports {target}")
    assert upward == []


def test_no_import_cycles_between_modules():
    graph: dict[str, set[str]] = {}
    for path, tree in _modules().items():
        name = "specrun." + path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        graph[name] = {t for _, targets in _internal_imports(tree) for t in targets}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if nxt not in graph or nxt.startswith(node + ".") or node.startswith(nxt + "."):
                continue  # a module, not a package boundary we can follow / a package and its own modules
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack + [node, nxt]))
            if nxt not in state:
                visit(nxt, stack + [node])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [])


def test_modules_stay_short_and_import_at_the_top():
    for path, tree in _modules().items():
        lines = (PACKAGE / path).read_text().count("\n")
        assert lines <= MAX_LINES, f"{path} has {lines} lines: a module that long is usually two concepts"
        if path == "cli.py":
            continue
        nested = [node.lineno for node, _ in _internal_imports(tree) if node.col_offset > 0]
        assert nested == [], f"{path} imports specrun modules inside functions at lines {nested}"
