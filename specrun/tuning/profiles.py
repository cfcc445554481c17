"""Stored tuning profiles: what `specrun tune` chose for this machine and this model pair.

A profile is one JSON file in paths.profiles_dir(). It is valid only for the hardware, the exact
model files, the llama.cpp build and the thread count it was measured with, so its key holds the
hardware fingerprint, each model file's size and modification time, the llama.cpp version and
the threads; the file name is a hash of that key. Change any of them and the profile is simply
not found: tune again.

Reading never fails a run: a missing, unreadable or corrupt profile is logged and ignored, and the
caller falls back to its defaults.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path

from specrun import engine, files, paths
from specrun.core.shapes import TreeShape, template_shape
from specrun.errors import SpecrunError
from specrun.tuning import measure as profiler
from specrun.tuning.cost_model import Choice

log = logging.getLogger("specrun.profiles")

# Bump when the stored layout changes in a way older readers would misread.
PROFILE_FORMAT = 1


@functools.lru_cache(maxsize=1)
def hardware_fingerprint() -> str:
    """Return this machine's hardware fingerprint (probed once per process)."""

    return profiler.probe_hardware().fingerprint()


def profile_key(
    target_path: Path, draft_path: Path | None, fingerprint: str | None = None, threads: int | None = None,
    gpu_memory: int | None = None,
) -> dict:
    """Return the key a profile for this pair on this machine and llama.cpp build is stored under.

    `threads` is the CPU thread count decoding runs with (None: engine.default_threads(), what a
    run without --threads uses): on a CPU the cost curves scale with it. `gpu_memory` is the
    --gpu-memory limit (an emulated smaller card places the model, and so costs, differently).
    """

    key = {
        "format": PROFILE_FORMAT,
        "hardware": fingerprint or hardware_fingerprint(),
        "llama": engine.llama_version_info(),
        "threads": threads or engine.default_threads(),
        "target": files.file_key(target_path),
        "draft": files.file_key(draft_path) if draft_path is not None else None,
    }
    if gpu_memory is not None:
        key["gpu_memory"] = gpu_memory  # absent otherwise: profiles made before the option stay valid
    return key


def profile_path(key: dict) -> Path:
    """Return the file that holds (or would hold) the profile for `key`."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return paths.profiles_dir() / f"{digest}.json"


def save(profile: dict) -> Path:
    """Write a profile (a dict with a "key") atomically; return its path."""
    path = profile_path(profile["key"])
    files.atomic_write_json(path, profile)
    return path



def first_suggestion(target_path: Path, draft_path: Path) -> bool:
    """Return True the first time a pair runs untuned (then suggest `specrun tune`), else False.

    Remembered per pair of model file names in profiles_dir()/suggested.json; a file that cannot
    be read or written only means the suggestion may come again.
    """
    path = paths.profiles_dir() / "suggested.json"
    pair = f"{Path(target_path).name} + {Path(draft_path).name}"
    seen = files.read_json(path, list, "record of tuning suggestions") or []
    if pair in seen:
        return False
    try:
        files.atomic_write_json(path, seen + [pair])
    except OSError as e:
        log.debug("cannot remember the tuning suggestion: %s", e)
    return True


def load(target_path: Path, draft_path: Path | None, threads: int | None = None,
         gpu_memory: int | None = None) -> dict | None:
    """Return the stored profile for this pair on this machine, or None (never raises for bad files)."""
    try:
        key = profile_key(target_path, draft_path, threads=threads, gpu_memory=gpu_memory)
    except OSError as e:
        log.warning("cannot identify the model files for a tuning profile: %s", e)
        return None
    return load_key(key)


def load_key(key: dict) -> dict | None:
    """Return the profile stored under `key`, or None when absent, unreadable or corrupt.

    A bad file (not UTF-8, not JSON, a configuration no tree can be built from) is reported once,
    naming the file, and counts as no profile: the run goes on with its defaults.
    """
    path = profile_path(key)
    profile = files.read_json(path, dict, "tuning profile")
    if profile is None:
        return None
    problem = _problem(profile, key)
    if problem:
        if path not in _reported:
            _reported.add(path)
            log.warning("ignoring tuning profile %s: %s; run `specrun tune` again", path, problem)
        return None
    return profile


# Profiles already reported as unusable in this process (a run may look one up more than once).
_reported: set[Path] = set()


def _problem(profile: dict, key: dict) -> str | None:
    """Return why a parsed profile cannot be used for `key`, or None."""

    if profile.get("key") != key:
        return "it was made for other files, hardware or llama.cpp build"
    try:
        _checked_choice(profile.get("config"))
    except (ValueError, TypeError, KeyError, AttributeError, SpecrunError) as e:
        return f"its configuration is not usable ({e})"
    return None


def _checked_choice(config) -> Choice:
    """Return the Choice a stored configuration stands for; raise if no decoder could be built from it."""
    if not isinstance(config, dict):
        raise TypeError("config is not a JSON object")
    choice = Choice.from_dict(config)
    if choice.kind == "specexec":
        TreeShape(choice.budget, choice.depth, choice.width, choice.top_k)  # raises on sizes out of range
    elif choice.kind == "sequoia" and choice.tree is None:
        raise ValueError("a Sequoia choice without its tree")
    elif choice.kind == "sequoia":
        template_shape(choice.tree)
    return choice


def choice_for(target_path: Path, draft_path: Path | None, threads: int | None = None,
               gpu_memory: int | None = None):
    """Return the tuned tuner.Choice for this pair, or None without a (valid) profile.

    Choice.kind tells the runtime what to build: "plain" (decode without the draft), "specexec"
    (TreeShape(budget, depth, width, top_k) with the default grower) or "sequoia" (the static tree
    in Choice.tree, grown by sequoia_draft.StaticTreeGrower).
    """

    if draft_path is None:
        return None
    profile = load(target_path, draft_path, threads, gpu_memory)
    if profile is None:
        return None
    return _checked_choice(profile["config"])
