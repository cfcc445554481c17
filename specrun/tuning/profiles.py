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
from typing import Any

from specrun import engine, files, paths
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
    target_path: Path, draft_path: Path | None, fingerprint: str | None = None, threads: int | None = None
) -> dict:
    """Return the key a profile for this pair on this machine and llama.cpp build is stored under.

    `threads` is the CPU thread count decoding runs with (None: engine.default_threads(), what a
    run without --threads uses): on a CPU the cost curves scale with it.
    """

    return {
        "format": PROFILE_FORMAT,
        "hardware": fingerprint or hardware_fingerprint(),
        "llama": engine.llama_version_info(),
        "threads": threads or engine.default_threads(),
        "target": files.file_key(target_path),
        "draft": files.file_key(draft_path) if draft_path is not None else None,
    }


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


def load(target_path: Path, draft_path: Path | None, threads: int | None = None) -> dict | None:
    """Return the stored profile for this pair on this machine, or None (never raises for bad files)."""
    try:
        key = profile_key(target_path, draft_path, threads=threads)
    except OSError as e:
        log.warning("cannot identify the model files for a tuning profile: %s", e)
        return None
    return load_key(key)


def load_key(key: dict) -> dict | None:
    """Return the profile stored under `key`, or None when absent, unreadable or corrupt."""
    path = profile_path(key)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("ignoring tuning profile %s: %s", path, e.strerror or e)
        return None
    try:
        profile = json.loads(text)
        problem = _problem(profile, key)
    except (ValueError, TypeError, KeyError) as e:
        problem = f"not valid profile JSON ({e})"
    if problem:
        log.warning("ignoring tuning profile %s: %s; run `specrun tune` again", path, problem)
        return None
    return profile


def _problem(profile: Any, key: dict) -> str | None:
    """Return why a parsed profile cannot be used for `key`, or None."""

    if not isinstance(profile, dict):
        return "not a JSON object"
    if profile.get("key") != key:
        return "it was made for other files, hardware or llama.cpp build"
    Choice.from_dict(profile["config"])  # raises on a malformed configuration
    return None


def choice_for(target_path: Path, draft_path: Path | None, threads: int | None = None):
    """Return the tuned tuner.Choice for this pair, or None without a (valid) profile.

    Choice.kind tells the runtime what to build: "plain" (decode without the draft), "specexec"
    (TreeShape(budget, depth, width, top_k) with the default grower) or "sequoia" (the static tree
    in Choice.tree, grown by sequoia_draft.StaticTreeGrower).
    """

    if draft_path is None:
        return None
    profile = load(target_path, draft_path, threads)
    if profile is None:
        return None
    return Choice.from_dict(profile["config"])
