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
import math
from dataclasses import dataclass
from pathlib import Path

from specrun import engine, files, paths
from specrun.core.tree_shapes import TreeShape, template_shape
from specrun.decoding.adaptive import DraftPrior
from specrun.errors import SpecrunError
from specrun.hardware.machine import probe_hardware
from specrun.tuning.cost_model import Choice, CostCurve

log = logging.getLogger("specrun.profiles")

# Bump when the stored layout changes in a way older readers would misread.
PROFILE_FORMAT = 1


@functools.lru_cache(maxsize=1)
def hardware_fingerprint() -> str:
    """Return this machine's hardware fingerprint (probed once per process)."""

    return probe_hardware().fingerprint()


def profile_key(
    target_path: Path, draft_path: Path | None, fingerprint: str | None = None, threads: int | None = None,
    gpu_memory: int | None = None, mmap: bool | None = None, flash_attn: str | None = None,
    kv_type: str | None = None, head: str | None = None,
) -> dict:
    """Return the key a profile for this pair on this machine and llama.cpp build is stored under.

    `threads` is the CPU thread count decoding runs with (None: engine.default_threads(), what a
    run without --threads uses): on a CPU the cost curves scale with it. `gpu_memory` is the
    --gpu-memory limit (an emulated smaller card places the model, and so costs, differently);
    `mmap` --mmap or --no-mmap (a target's layers in RAM copied for big passes from pinned memory
    or from the mapped file cost differently); `flash_attn` --flash-attn (on a CPU a tree pass over a
    long context costs up to 1.8x more with it on); `kv_type` --kv-type (a quantized cache's passes
    cost otherwise); `head` --head here (over RPC workers, a tree's pass moves no logits rows).
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
    if mmap is not None:
        key["mmap"] = mmap  # (likewise)
    if flash_attn is not None:
        key["flash_attn"] = flash_attn  # (likewise)
    if kv_type is not None:
        key["kv_type"] = kv_type  # (likewise)
    if head is not None:
        key["head"] = head  # (likewise)
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
         gpu_memory: int | None = None, mmap: bool | None = None, flash_attn: str | None = None,
         kv_type: str | None = None, head: str | None = None) -> dict | None:
    """Return the stored profile for this pair on this machine, or None (never raises for bad files)."""
    try:
        key = profile_key(target_path, draft_path, threads=threads, gpu_memory=gpu_memory, mmap=mmap,
                          flash_attn=flash_attn, kv_type=kv_type, head=head)
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
               gpu_memory: int | None = None, mmap: bool | None = None, flash_attn: str | None = None,
               kv_type: str | None = None):
    """Return the tuned tuner.Choice for this pair, or None without a (valid) profile.

    Choice.kind tells the runtime what to build: "plain" (decode without the draft), "specexec"
    (TreeShape(budget, depth, width, top_k) with the default grower) or "sequoia" (the static tree
    in Choice.tree, grown by sequoia_draft.StaticTreeGrower).
    """

    if draft_path is None:
        return None
    profile = load(target_path, draft_path, threads, gpu_memory, mmap, flash_attn, kv_type)
    return choice_of(profile) if profile is not None else None


def choice_of(profile: dict):
    """Return the tuned tuner.Choice of a profile `load` returned (choice_for)."""
    choice = _checked_choice(profile["config"])
    if choice.kind == "plain" and "workloads" not in profile:
        path = profile_path(profile["key"])
        if path not in _reported:
            _reported.add(path)
            # An older profile's "plain" was a verdict on the draft model's trees, read as "no
            # drafting at all". Read now as what it measured: those trees off, lookup on.
            log.warning("the tuning profile %s (from an older specrun) found the draft model's trees slower than "
                        "plain decoding: they stay off, lookup stays on; `specrun tune` again measures every drafter", path)
    return choice


@dataclass(frozen=True)
class Facts:
    """What a profile measured on this machine (not what it chose): the runs decide from these
    and from what they measure themselves."""

    target: CostCurve  # seconds of one target pass over n tokens
    draft: CostCurve  # seconds of one draft pass over n tokens (its top-k included)
    plain_s: float  # seconds per token of plain decoding
    tau: dict[int, float]  # tokens per pass (bonus included) of best-first draft trees, by budget
    tree_speedup: float | None  # the profile's best draft tree against plain decoding, measured
    # (budget, depth, tokens per pass) of that tree as the held-out check decoded it: what the
    # calibration's best-first tau says of other trees of its size does not hold for it (a chain
    # of 7 from a draft that agrees 97% of the time passes ~7.8 tokens; best-first trees of 7, ~4.8).
    checked: tuple[int, int, float] | None = None
    # The target's one-token pass as a run times it at load, to check the profile still holds
    # (profiles made before tune timed it so: plain decoding's mean pass).
    pass_s: float | None = None

    @property
    def catch_up_s(self) -> float:
        """Seconds per token of the draft's catch-up (its widest measured pass, per token)."""
        widest = self.draft.sizes[-1]
        return self.draft.t(widest) / widest

    def draft_prior(self, shape: TreeShape) -> DraftPrior:
        """The draft model's expected costs and acceptance for trees of this shape."""
        width = max(1, min(shape.width, shape.budget))
        passes = max(shape.depth if width == 1 else 1, math.ceil(shape.budget / width))
        passes = min(passes, shape.budget)
        known = [b for b in self.tau if b <= shape.budget]
        tau = self.tau[max(known)] if known else 1.0
        if self.checked is not None and self.checked[:2] == (shape.budget, shape.depth):
            tau = self.checked[2]
        return DraftPrior(
            plain_s=self.plain_s, tree_s=self.target.t(shape.budget + 1), step_s=passes * self.draft.t(width),
            catch_up_s=self.catch_up_s, accepted=max(0.0, tau - 1.0),
        )


def facts_of(profile: dict) -> Facts | None:
    """Return a profile's measured facts, or None when it lacks them (never raises)."""
    try:
        curves = profile["curves"]
        draft = CostCurve.from_dict(curves["draft"])
        topk = CostCurve.from_dict(curves["draft_topk"]) if curves.get("draft_topk") else None
        if topk is not None:
            draft = CostCurve(draft.sizes, tuple(s + topk.t(n) for n, s in zip(draft.sizes, draft.seconds)))
        plain = profile["plain"]
        check = profile.get("check") or {}
        return Facts(
            target=CostCurve.from_dict(curves["target"]), draft=draft,
            plain_s=float(plain["target_s"]) + float(plain.get("overhead_s", 0.0)),
            tau={int(b): float(t) for b, t in profile["acceptance"]["tau"].items()},
            tree_speedup=float(check["tree_measured_speedup"]) if "tree_measured_speedup" in check else None,
            checked=_checked_tree(profile.get("best_tree"), check),
            pass_s=float(plain.get("load_pass_s") or plain["target_s"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        log.debug("the tuning profile's measurements are not usable: %s", e)
        return None


def _checked_tree(best_tree: dict | None, check: dict) -> tuple[int, int, float] | None:
    """(budget, depth, tokens per pass) of the tree the held-out check decoded, when measured."""
    if not best_tree or best_tree.get("kind", "plain") == "plain" or not check.get("accepted_per_pass"):
        return None
    return int(best_tree["budget"]), int(best_tree["depth"]), float(check["accepted_per_pass"])
