"""Test resources from the pinned llama-cpp-python sdist: real chat templates, vocab-only GGUFs
with real tokenizers, and gguf-py with every architecture's tensor layout.

The sdist (the same file pip builds llama-cpp-python from) is taken from pip's cache or downloaded
from PyPI once, and the parts tests use are extracted into specrun's model cache beside the other
offline models. Extraction is atomic: a folder that exists is complete.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{SDIST_VERSION}"
# Inside the sdist: what tests read, relative to vendor/llama.cpp.
WANTED_PREFIXES = ("models/templates/", "models/ggml-vocab-", "gguf-py/")


def _cache_root() -> Path:
    return Path(os.environ.get("SPECRUN_HOME") or Path.home() / ".cache" / "specrun") / "pinned-sources"


def _download_sdist(into: Path) -> Path:
    """Return the sdist's path in `into`, fetched with pip (its cache first, PyPI otherwise)."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
        f"llama-cpp-python=={SDIST_VERSION}", "-d", str(into),
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return into / f"{SDIST_NAME}.tar.gz"


def llama_cpp_sources() -> Path:
    """Return vendor/llama.cpp of the pinned sdist, holding only the parts tests read."""
    root = _cache_root()
    done = root / SDIST_NAME
    if done.is_dir():
        return done
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".extract-") as tmp:
        tmp = Path(tmp)
        local = os.environ.get("SPECRUN_SDIST")  # an already downloaded copy, if the user has one
        sdist = Path(local) if local else _download_sdist(tmp)
        prefix = f"{SDIST_NAME}/vendor/llama.cpp/"
        out = tmp / "out"
        with tarfile.open(sdist) as tar:
            members = [
                m for m in tar.getmembers()
                if m.isfile() and m.name.startswith(prefix)
                and m.name[len(prefix):].startswith(WANTED_PREFIXES)
            ]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(out, members=members, filter="data")
        try:
            os.rename(out, done)
        except OSError:
            if not done.is_dir():  # another process won the race: its copy is complete
                raise
            shutil.rmtree(out, ignore_errors=True)
    return done


def template(name: str) -> str:
    """Return the text of models/templates/<name>.jinja."""
    return (llama_cpp_sources() / "models" / "templates" / f"{name}.jinja").read_text()


def vocab_gguf(name: str) -> Path:
    """Return models/ggml-vocab-<name>.gguf, a vocab-only GGUF with a real tokenizer."""
    return llama_cpp_sources() / "models" / f"ggml-vocab-{name}.gguf"


def gguf_py() -> Path:
    """Return the folder to put on sys.path to import the pinned gguf-py (`import gguf`)."""
    return llama_cpp_sources() / "gguf-py"
