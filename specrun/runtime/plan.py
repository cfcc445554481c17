"""One plan before anything loads: files, drafter, tree, contexts, GPU layers and memory.

`build_plan(opts)` decides everything a run needs, in this order, and nothing later changes it:

1. the model files (registry aliases resolved; missing files fetched unless `fetch=False`);
2. the drafter and its tree (`runtime.trees`): explicit --budget/--depth > the stored tuning profile > the default
   chain; or plain decoding (no draft, --no-spec, or --no-lookup with a profile that measured the
   draft model's trees slower than plain decoding: without --no-lookup such a profile leaves
   lookup alone on). `--draft lookup` drafts from the session's text alone (no draft model);
   lookup branches join the draft model's trees by default (hybrid); `--draft mtp` drafts chains
   with the target's own MTP layers, and a target that carries them drafts so when no --draft
   is given;
3. the contexts: n_ctx, and n_batch = n_ubatch large enough for the largest tree + its root in
   one pass (a tree split over ubatches pays the weight transfer again when offloading); the
   target's attention as --flash-attn says, else, where it runs on this CPU for one request at
   a time, as measured here (tuning.flash_attention: tune's record, or an estimate at the
   target's first start), else llama.cpp's;
4. GPU layers for the target and the draft, planned for exactly that n_ubatch (the compute
   buffer grows with it), and the memory expected on each device and in RAM.

`Runtime(plan)` loads exactly this; `specrun plan` prints it without loading any weights (but at an
untuned target's first start, the flash attention measurement's: once).

A plan made from a tuning profile carries one check (`Plan.check`): the profile's figures hold
for the machine as it was when tuned. At load the target's one-token pass is timed; where it is
off the profile's by more than decoding.pay's PROFILE_DRIFT (a laptop on battery, another power state, a busy
machine), the run loads `check.fallback` instead: the plan made as without a profile, whose
drafter times both models itself. It is offered only where it loads the target the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

from specrun import architectures, engine, sysinfo
from specrun.core.tree_shapes import TreeShape
from specrun.decoding.pay.rules import PROFILE_DRIFT, profile_holds
from specrun.engine import rpc
from specrun.errors import EngineError, UsageError
from specrun.files import once_per_version
from specrun.hardware import offload, placement
from specrun.limits import MAX_SEQ
from specrun.models import headers, registry, shapes
from specrun.runtime.model_files import resolve_models
from specrun.runtime.options import LOOKUP, ModelFiles, RunOptions, with_target_options
from specrun.runtime.drafters import BEST_FIRST
from specrun.runtime.trees import MAX_CHAINS, TreePlan, choose_tree, fit_tree, fit_tree_to_target
from specrun.tuning import flash_attention

log = logging.getLogger("specrun")

# Prompts are prefilled in batches of this many tokens.
PREFILL_BATCH = 512
# Requests a server decodes together unless --parallel says otherwise, where that many fit at the
# context one request gets (the measured 2x of four clients over one on the 2-core test host).
DEFAULT_PARALLEL = 4
# The leaves a request's tree may have on a sliding-window target, whose cache keeps a window of
# cells per sequence (one per leaf): a larger tree is verified in its best part with this many.
WINDOW_LEAVES = 16


@dataclass(frozen=True)
class ContextPlan:
    """llama.cpp context sizes: cells, batch = ubatch (tokens per forward pass), sequences."""

    n_ctx: int  # tokens one request may hold
    n_batch: int
    n_seq_max: int
    n_rs_seq: int = 0  # recurrent-state snapshots per sequence (rollback of a verified chain)
    parallel: int = 1  # requests decoding together, each a range of its sequences and n_ctx cells (decoding.batching)
    # Sliding-window layers keep every cell: a draft model's context (each tree node a sequence
    # holding the whole text, and llama.cpp reuses a cell its window has passed only when one
    # sequence holds it) and chains (a hybrid's state and window cells are not given back apart).
    # A target's plain decoding and trees keep their window only, as llama.cpp does (Gemma 3 27B at
    # 32k, plain: about 3 GiB of KV in place of 15.5); trees give back the cells behind the window
    # before they share the text with their colours (decoding.kv.CachedSequence.share_window).
    swa_full: bool = True
    n_outputs: int = 0  # the most rows of logits one pass asks for (every request's tree or chains)
    flash_attn: str | None = None  # --flash-attn (a target's context): on, off or auto; None: engine.Context's default
    kv_type: str | None = None  # --kv-type (a target's context): its KV cache's cells; None: f16
    split: bool = False  # --kv-split (a target's context shared by requests): a cache for each, one sequence

    @property
    def n_ubatch(self) -> int:
        return self.n_batch  # the engine sets n_ubatch = n_batch: one pass per batch

    @property
    def cells(self) -> int:
        """The KV cells llama.cpp is asked for: n_ctx for each request."""
        return self.n_ctx * self.parallel


@dataclass(frozen=True)
class Plan:
    """Everything a run loads, decided before any weights are read."""

    files: ModelFiles
    tree: TreePlan | None  # None: plain decoding, the draft is not loaded
    why: str  # one line: why this tree (or plain decoding)
    target_ctx: ContextPlan
    draft_ctx: ContextPlan | None
    threads: int
    placement: offload.OffloadPlan
    devices: tuple[offload.Device, ...] = ()
    untuned: bool = False  # speculating with the default tree: no profile for the pair
    notes: tuple[str, ...] = field(default=())
    ctx_why: str = "--ctx-size"  # why this context size
    n_ctx_train: int = 0  # the target's trained context, when read (0: not read)
    check: ProfileCheck | None = None  # a tuning profile decided: what the load re-times
    round_trips: tuple[tuple[str, float], ...] = ()  # (RPC worker, seconds of a round trip to it)
    mmap: bool | None = None  # the target's file mapped, or read (offload.target_mapped); None: llama.cpp's way
    head_here: bool = False  # the target's output layer computes on this machine, not an RPC worker (--head)
    attention_why: str = ""  # where a measurement chose the target's flash attention (tuning.flash_attention)

    def checked(self, target_pass_s: float | None) -> Plan:
        """Return the plan to load once the target's one-token pass is timed (None: could not
        be): this one while the tuning profile's timing holds, else the plan made without it."""
        if self.check is None or target_pass_s is None or self.check.holds(target_pass_s):
            return self
        why = (f"the target's one-token pass takes {target_pass_s * 1e3:.1f} ms now against "
               f"{self.check.pass_s * 1e3:.1f} ms when the tuning profile was made: deciding as without it")
        return replace(self.check.fallback, why=f"{why}; {self.check.fallback.why}")

    @property
    def speculative(self) -> bool:
        return self.tree is not None

    def device_layers(self) -> list[int]:
        """Return the target's layer slots on each of `devices`, in order."""
        split = self.placement.target_tensor_split
        return [int(n) for n in split] if split else [0] * len(self.devices)

    @property
    def network_s(self) -> float:
        """Seconds each target pass spends on the network: a round trip to every RPC worker
        holding layers (its stretch of layers returns its result once per pass)."""
        holding = {d.host for d, n in zip(self.devices, self.device_layers()) if d.host and n}
        return sum(seconds for host, seconds in self.round_trips if host in holding)

    @property
    def drafter(self) -> str:
        """Which drafter proposes trees: "draft model", "sequoia", "lookup", "hybrid", "mtp" or "none"."""
        return "none" if self.tree is None else self.tree.drafter

    @property
    def draft_loaded(self) -> bool:
        """Whether a draft model is loaded (speculating, and not with lookup alone)."""
        return self.tree is not None and self.tree.drafting.loads_draft_model

    @property
    def target_gpu_layers(self) -> int:
        return self.placement.target_gpu_layers

    @property
    def draft_gpu_layers(self) -> int:
        return self.placement.draft_gpu_layers if self.placement.draft_device is not None else 0

    def to_dict(self) -> dict:
        f = self.files
        tree = None
        if self.tree is not None:
            s = self.tree.shape
            tree = {"kind": self.tree.kind, "verify": self.tree.verify, "source": self.tree.source, "budget": s.budget, "depth": s.depth,
                    "width": s.width, "top_k": s.top_k, "text": self.tree.describe(),
                    "lookup_budget": self.tree.lookup.budget if self.tree.lookup else 0,
                    "grows_to": self.tree.grow, "verified_budget": self.tree.verified.budget}
        return {
            "target": {"name": f.target_name, "path": _path(f.target_path), "gpu_layers": self.target_gpu_layers,
                       "layer_slots": self.placement.target_n_slots, "mmap": self.mmap is not False, "head_here": self.head_here,
                       "experts_in_ram_layers": self.placement.cpu_expert_layers, "head_why": self.placement.head_why},
            "draft": None if f.draft_name is None or not self.draft_loaded else {
                "name": f.draft_name, "path": _path(f.draft_path), "gpu_layers": self.draft_gpu_layers,
                "device": (self.devices[self.placement.draft_device].name
                           if self.placement.draft_device is not None else "RAM"),
            },
            "drafter": self.drafter,
            "tree": tree,
            "why": self.why,
            "flash_attn_why": self.attention_why or None,
            "contexts": {
                "target": _ctx_dict(self.target_ctx),
                "draft": _ctx_dict(self.draft_ctx) if self.draft_ctx else None,
            },
            "context": {"n_ctx": self.target_ctx.n_ctx, "why": self.ctx_why, "n_ctx_train": self.n_ctx_train or None},
            "threads": self.threads,
            "network": None if not self.round_trips else {
                "round_trip_s": dict(self.round_trips), "per_pass_s": self.network_s},
            "memory": {
                "devices": [
                    {"name": d.name, "host": d.host or None, "layers": layers, "planned_bytes": used,
                     "free_bytes": d.free_bytes, "limit_bytes": limit}
                    for d, layers, used, limit in zip(self.devices, self.device_layers(), self.placement.device_bytes,
                                                      self.placement.device_limit_bytes)
                ],
                "ram": {"planned_bytes": self.placement.ram_bytes, "limit_bytes": self.placement.ram_limit_bytes},
                "fits": self.placement.fits,
                # per device, then RAM: weights, KV cache and recurrent state, compute, logits
                "breakdown": [place.to_dict() for place in self.placement.breakdown],
                "figures": "llama.cpp" if self.placement.measured else "estimated",
            },
            "warnings": list(self.placement.warnings) + list(self.notes),
            "profile_check": None if self.check is None else {
                "target_pass_s": self.check.pass_s, "drift": PROFILE_DRIFT,
                "otherwise": {"drafter": self.check.fallback.drafter, "draft_loaded": self.check.fallback.draft_loaded,
                              "tree": self.check.fallback.tree.describe() if self.check.fallback.tree else None},
            },
        }


@dataclass(frozen=True)
class ProfileCheck:
    """A tuning profile's timing of the target, checked at load, and the plan made without the
    profile, loaded where that timing no longer holds (the target loads the same in both)."""

    pass_s: float  # the target's one-token pass when the profile was made
    fallback: Plan

    def holds(self, target_pass_s: float) -> bool:
        """Whether a one-token pass timed now is close enough to the profile's (pay.profile_holds)."""
        return profile_holds(target_pass_s, self.pass_s)

    def describe(self) -> str:
        fallback = self.fallback
        otherwise = f"{fallback.drafter}: {fallback.tree.describe()}" if fallback.tree else "plain decoding"
        return (f"at load the target's one-token pass is timed; more than {PROFILE_DRIFT:.0%} off the profile's "
                f"{self.pass_s * 1e3:.1f} ms, the run decides as without the profile ({otherwise})")


def _path(path: Path | None) -> str | None:
    return str(path) if path is not None else None


def _ctx_dict(ctx: ContextPlan) -> dict:
    return {"n_ctx": ctx.n_ctx, "n_batch": ctx.n_batch, "n_ubatch": ctx.n_ubatch, "n_seq_max": ctx.n_seq_max,
            "n_rs_seq": ctx.n_rs_seq, "parallel": ctx.parallel, "cells": ctx.cells, "swa_full": ctx.swa_full, "split": ctx.split,
            "flash_attn": ctx.flash_attn or engine.default_flash_attn(ctx.kv_type), "kv_type": ctx.kv_type or engine.DEFAULT_KV_TYPE}


# ---------------------------------------------------------------------------------------------
# Building a plan


def build_plan(
    opts: RunOptions,
    shape: TreeShape | None = None,
    *,
    fetch: bool = True,
    devices: list | None = None,
    ram_free_bytes: int | None = None,
    sizes: tuple[offload.ModelSize, offload.ModelSize | None] | None = None,
    detailed: bool = False,
) -> Plan:
    """Return the plan for these options.

    `shape` forces a tree (tuning calibrates with one). `devices` (engine.DeviceInfo-like),
    `ram_free_bytes` and `sizes` replace what this machine and the model files say: that is how
    GPU plans are reviewed on a machine without a GPU, or before a model is downloaded. Without a
    GPU nothing needs placing, so the models' shapes are read (seconds for a large vocabulary)
    only when `detailed` asks for the memory estimate; otherwise RAM is counted as the files.
    """
    files = resolve_models(opts, fetch=fetch)
    if shape is not None and files.draft_name is None:
        raise UsageError(f"no draft model for {files.target_name}: pass --draft")
    connect_workers(opts)
    if devices is None:
        devices = engine.list_devices()
    elif opts.rpc:  # GPUs given for another machine, beside the workers
        devices = [*devices, *engine.remote_devices()]
    if ram_free_bytes is None:
        # Read once: the context search and the final check must hold the plan to the same RAM (the
        # simulated loads in between take memory of this process that the run will not).
        ram_free_bytes = sysinfo.ram_bytes()[1]
    plan = _requests_at_once(opts, files, shape, devices, ram_free_bytes, sizes, detailed)
    if plan.placement.fits or shape is not None or opts.draft is not None or opts.no_spec or plan.tree is None:
        return plan  # (a drafter the user chose is planned as chosen, fitting or not)
    # The default drafter does not fit beside the target (a draft model, a hybrid's state copies for
    # chains): the lightest drafting that does, down to plain decoding, rather than a plan that
    # would run from disk.
    bare = replace(files, draft_name=None, draft_path=None, mtp=False, mtp_why="")
    lighter = []
    if (plan.draft_loaded or files.mtp) and opts.lookup is not False:
        lighter.append((replace(opts, draft=LOOKUP), "lookup trees alone (no draft model)"))
    for other_opts, what in [*lighter, (replace(opts, no_spec=True), "plain decoding")]:
        other = _requests_at_once(other_opts, bare, None, devices, ram_free_bytes, sizes, detailed)
        if other.placement.fits:
            drafting = f"the draft model {files.draft_name}" if plan.draft_loaded else f"{plan.drafter} drafting"
            note = (f"{drafting} does not fit beside {files.target_name} on this machine, even with a "
                    f"{plan.target_ctx.n_ctx}-token context: planned with {what}")
            return replace(other, notes=(*other.notes, note))
    return plan


def _requests_at_once(opts: RunOptions, files: ModelFiles, shape: TreeShape | None, devices: list,
                      ram_free_bytes: int, sizes, detailed: bool) -> Plan:
    """The plan for --parallel as given, or for as many requests at once as fit (build_plan's
    arguments)."""
    if opts.parallel is not None:
        return _build(opts, files, shape, devices, ram_free_bytes, sizes, detailed, use_profile=True)
    # As many requests at once as fit at the context one request gets alone (at most DEFAULT_PARALLEL).
    alone = _build(replace(opts, parallel=1), files, shape, devices, ram_free_bytes, sizes, detailed, use_profile=True)
    for n in range(DEFAULT_PARALLEL, 1, -1):
        wider = _build(replace(opts, ctx_size=alone.target_ctx.n_ctx, parallel=n), files, shape, devices,
                       ram_free_bytes, sizes, detailed, use_profile=True)
        # ...and only where the target's layers stay where they are alone: never slower for one request.
        a, b = wider.placement, alone.placement
        same_layers = (a.target_gpu_layers, a.target_tensor_split, a.cpu_expert_layers) == (
            b.target_gpu_layers, b.target_tensor_split, b.cpu_expert_layers)
        if wider.target_ctx.parallel == n and a.fits and same_layers and wider.draft_gpu_layers == alone.draft_gpu_layers:
            return replace(wider, ctx_why=alone.ctx_why)
    return alone


def connect_workers(opts: RunOptions) -> None:
    """Add the --rpc workers' devices to this machine's (once per process): before anything is
    planned, and before a tuning profile is looked up (they are part of the machine it was made on)."""
    if opts.rpc:
        rpc.connect(opts.rpc)


def _build(opts: RunOptions, files: ModelFiles, shape: TreeShape | None, devices: list,
           ram_free_bytes: int | None, sizes, detailed: bool, use_profile: bool, seq_budget: int = 0) -> Plan:
    """Return the plan for resolved files (build_plan's arguments); `use_profile=False` decides
    as without a tuning profile: the plan a profile's check falls back to. `seq_budget`: a tree
    budget the target context's sequences are opened for if larger than this plan's tree."""
    pass_s = None
    if shape is not None:
        tree, why, untuned = TreePlan(shape, BEST_FIRST, "flags"), "tree given by the caller", False
    else:
        tree, why, untuned, pass_s = choose_tree(opts, files, use_profile)
    notes = []
    # A model not downloaded yet is planned from its real header (a sparse copy: models.headers), or
    # from the shape the registry states for it (models.shapes),
    # unless shapes are given in its place.
    target_file = files.target_path or (None if sizes else _header_copy(files.target_name, notes))
    draft_file = files.draft_path or (None if sizes or files.draft_name is None else _header_copy(files.draft_name, notes))
    target_arch = engine.gguf_architecture(target_file) if target_file is not None else None
    draft_arch = engine.gguf_architecture(draft_file) if draft_file is not None else None
    tree, why = _tree_for_models(tree, why, target_arch, draft_arch, notes)
    if pass_s is not None:
        # The profile's check may fall back to the untuned plan on the target context loaded for
        # this one: both open sequences for the larger of their trees (_contexts).
        fallback_tree = _tree_for_models(choose_tree(opts, files, use_profile=False)[0], "", target_arch,
                                         draft_arch, [])[0]
        seq_budget = max(seq_budget, fallback_tree.verified.budget if fallback_tree is not None else 0)
    threads, cores = opts.threads or engine.default_threads(), engine.default_threads()
    if threads > cores:
        # More threads than cores only makes them wait for each other (and 999 would start 999).
        notes.append(f"--threads {threads} is more than the {cores} CPU cores this process may use: using {cores}")
        threads = cores
    gpus = placement.gpus_of(devices)
    if opts.gpu_memory is not None:
        if not gpus:
            notes.append("--gpu-memory has no effect: no GPU was found")
        gpus = offload.capped_devices(gpus, opts.gpu_memory)
    draft_path = draft_file if tree is not None and tree.drafting.loads_draft_model else None
    auto_ctx = opts.ctx_size is None
    target_size = draft_size = None
    if gpus or sizes is not None or detailed or auto_ctx:
        target_size = sizes[0] if sizes else _model_size(files.target_name, target_file)
        if draft_path is not None or (sizes and tree is not None and tree.drafting.loads_draft_model):
            draft_size = sizes[1] if sizes else _model_size(files.draft_name, draft_path)
    # llama.cpp's own figures for the files (not for shapes given in their place)
    parallel = opts.parallel or 1
    notes += opts.context_notes(parallel)
    flash_attn, attention_why = flash_attention.choose_flash_attn(opts, files.target_path, not gpus, parallel, threads)
    target_context = {**opts.target_context(), **({"flash_attn": flash_attn} if flash_attn else {})}
    measure = ContextMemory(None if sizes else target_file, None if sizes else draft_path, tree, draft_arch, parallel,
                            seq_budget, target_context)
    try:
        if auto_ctx:
            widest = max(PREFILL_BATCH, tree.verified.budget + 1 if tree is not None else 0)
            n_ctx, ctx_why = placement.largest_context(target_size, draft_size, gpus, widest, opts.gpu_layers,
                                                       ram_free_bytes, measured=measure, kv_type=opts.kv_type)
        else:
            n_ctx, ctx_why = opts.ctx_size, "--ctx-size"
        if tree is not None and tree.verified.budget + 1 > n_ctx:
            # A tree and its root must fit the context in one pass (llama.cpp caps n_batch at n_ctx).
            notes.append(f"a tree of {tree.verified.budget} tokens does not fit a {n_ctx}-token context: "
                         f"using {n_ctx - 1}")
            tree = fit_tree(tree, n_ctx - 1)
            measure.tree = tree
        target_ctx, draft_ctx = _contexts(tree, n_ctx, draft_arch, parallel, measure.windowed, seq_budget, target_context)
        if target_size is None:
            measured = measure(n_ctx)
            placed = placement.cpu_only([p for p in (target_file, draft_path) if p is not None], ram_free_bytes,
                                        measured if measured[0] is not None else ())
        else:
            placed = placement.plan(
                target_size, draft_size, gpus, n_ctx, target_ctx.n_ubatch, override=opts.gpu_layers,
                ram_free_bytes=ram_free_bytes, measured=measure, kv_type=opts.kv_type, head_here=opts.head_here,
                head_rows=placement.HEAD_ROWS if tree is not None else 1)
        notes.extend(measure.notes)
        plan = Plan(
            files=files, tree=tree, why=why, target_ctx=target_ctx, draft_ctx=draft_ctx,
            threads=threads, placement=placed, devices=gpus, untuned=untuned,
            notes=tuple(notes), ctx_why=ctx_why, n_ctx_train=target_size.n_ctx_train if target_size else 0,
            round_trips=tuple((host, rpc.round_trip_s(host) or 0.0) for host in dict.fromkeys(d.host for d in gpus if d.host)),
            mmap=opts.mmap if opts.mmap is not None else offload.target_mapped(placed, gpus),
            head_here=placed.head_in_ram, attention_why=attention_why,
        )
        if pass_s is not None:
            fallback = _build(opts, files, None, devices, ram_free_bytes, sizes, detailed, use_profile=False,
                              seq_budget=max(seq_budget, tree.verified.budget if tree is not None else 0))
            if fallback.placement.fits and _loads_target_alike(plan, fallback):
                plan = replace(plan, check=ProfileCheck(pass_s, fallback))
        return plan
    finally:
        measure.close()


def _tree_for_models(tree: TreePlan | None, why: str, target_arch: str | None, draft_arch: str | None,
                     notes: list[str]) -> tuple[TreePlan | None, str]:
    """The tree as the target can verify it and the draft can draft it (notes: what changed)."""
    if tree is not None and target_arch is not None:
        tree, why, note = fit_tree_to_target(tree, why, target_arch)
        if note:
            notes.append(note)
    if tree is not None and draft_arch and architectures.has_state(draft_arch):
        tree = tree.drafting.for_recurrent_draft(tree)
    return tree, why


def _contexts(tree: TreePlan | None, n_ctx: int, draft_arch: str | None, parallel: int = 1, windowed: bool = False,
              seq_budget: int = 0, target: dict | None = None) -> tuple[ContextPlan, ContextPlan | None]:
    """Return the target's and the draft's contexts (None: no draft model) for requests of n_ctx
    tokens, `parallel` of them decoding together (each context's sequences and cells split between
    them); `windowed`: the target has sliding-window layers, whose sequences are opened for the
    larger of the tree's budget and `seq_budget`; `target`: more of the target's (RunOptions.target_context)."""
    if tree is None:
        return with_target_options(ContextPlan(n_ctx, min(n_ctx, PREFILL_BATCH), parallel, parallel=parallel, swa_full=False), target, parallel), None
    if tree.verify in (architectures.CHAINS, architectures.CHAIN):
        # A sequence per chain (MTP drafts one), and snapshots to roll the state back by the
        # rejected drafts.
        n_chains = MAX_CHAINS if tree.verify == architectures.CHAINS else 1
        chain_tokens = n_chains * (tree.verified.depth + 1)
        target_ctx = ContextPlan(n_ctx, min(n_ctx, max(PREFILL_BATCH, chain_tokens)), min(MAX_SEQ, n_chains * parallel),
                                 tree.verified.depth, parallel=parallel, n_outputs=chain_tokens * parallel)
    else:
        # llama.cpp gives a window-sized cache a window per sequence: a sliding-window target
        # opens one per leaf of the largest tree (and the text's), for each request. Others keep
        # every sequence (no memory of their own). A plan with a tuning profile and the one
        # without it open the same target context (Plan.check loads either on it): `seq_budget`.
        widest = max(tree.verified.budget, seq_budget)
        per_request = min(widest, WINDOW_LEAVES) + 1 if windowed else MAX_SEQ
        target_ctx = ContextPlan(n_ctx, min(n_ctx, max(PREFILL_BATCH, tree.verified.budget + 1)),
                                 min(MAX_SEQ, per_request * parallel), parallel=parallel, swa_full=False,
                                 n_outputs=(widest + 1) * parallel)
    target_ctx = with_target_options(target_ctx, target, parallel)
    draft_ctx = None
    if tree.drafting.loads_draft_model:
        # A draft with a recurrent state keeps one state per tree sequence: only as many as
        # its tree has nodes (each node's state is its parent's, copied, plus its token).
        # Several requests share one draft context as they share the target's, a lane each.
        per_request = tree.shape.budget + 1 if draft_arch and architectures.has_state(draft_arch) else MAX_SEQ
        draft_ctx = ContextPlan(n_ctx, min(n_ctx, PREFILL_BATCH), min(MAX_SEQ, per_request * parallel),
                                parallel=parallel)
    return target_ctx, draft_ctx


class ContextMemory:
    """llama.cpp's own figures for a run's contexts at any n_ctx (placement.Measured): its
    simulated load of each file (engine.memory) with the contexts the run opens, the target's MTP
    context included. A file it cannot simulate is estimated by the planner, with a note."""

    def __init__(self, target_path: Path | None, draft_path: Path | None, tree: TreePlan | None,
                 draft_arch: str | None, parallel: int = 1, seq_budget: int = 0, target: dict | None = None):
        self.tree, self.draft_arch, self.parallel, self.seq_budget, self.target = tree, draft_arch, parallel, seq_budget, target
        self.windowed = target_path is not None and engine.gguf_has_sliding_window(target_path)
        self.mtp = tree is not None and tree.drafting.loads_mtp
        self.notes: list[str] = []
        self._target = engine.Simulation(target_path, load_mtp=self.mtp) if target_path is not None else None
        self._draft = engine.Simulation(draft_path) if draft_path is not None else None

    def __call__(self, n_ctx: int) -> tuple[offload.ContextBytes | None, offload.ContextBytes | None]:
        target_ctx, draft_ctx = _contexts(self.tree, n_ctx, self.draft_arch, self.parallel, self.windowed,
                                          self.seq_budget, self.target)
        target_specs = [_spec(target_ctx)]
        if self.mtp:
            # as Runtime opens it: a sequence of n_ctx cells for each request
            target_specs.append(engine.ContextSpec(n_ctx * self.parallel, PREFILL_BATCH, self.parallel, mtp=True))
        draft = self._figures(self._draft, [_spec(draft_ctx)]) if draft_ctx is not None else None
        return self._figures(self._target, target_specs), draft

    def close(self) -> None:
        """Free the simulated models (their figures stay known, on disk too)."""
        for simulation in (self._target, self._draft):
            if simulation is not None:
                simulation.close()

    def _figures(self, simulation, specs) -> offload.ContextBytes | None:
        if simulation is None:
            return None
        try:
            total = sum((simulation.context(spec) for spec in specs), engine.Allocation())
        except EngineError as e:  # (a file llama.cpp cannot load at all fails here as the run would)
            note = f"llama.cpp could not size {simulation.path.name}'s contexts ({e}): its memory is estimated"
            if note not in self.notes:
                self.notes.append(note)
            return None
        return offload.ContextBytes(total.context, total.compute_total, total.output)


def _spec(ctx: ContextPlan):
    return engine.ContextSpec(ctx.cells, ctx.n_batch, ctx.n_seq_max, ctx.n_rs_seq, swa_full=ctx.swa_full,
                              n_outputs=ctx.n_outputs, flash_attn=ctx.flash_attn, kv_type=ctx.kv_type, split=ctx.split)


def _loads_target_alike(plan: Plan, other: Plan) -> bool:
    """Whether two plans load the target alike (layers, devices, context, threads, mmap): the second loads on the first's."""
    a, b = plan.placement, other.placement
    return ((a.target_gpu_layers, a.target_tensor_split, a.op_offload, plan.target_ctx, plan.threads, plan.mmap, plan.head_here)
            == (b.target_gpu_layers, b.target_tensor_split, b.op_offload, other.target_ctx, other.threads, other.mmap, other.head_here))


def _header_copy(name: str, notes: list[str]) -> Path:
    """Return a header-only copy of a registry model that is not downloaded: of its real header,
    or where that cannot be had (offline without one cached, the hub unreachable) one written from
    the shape the registry states for it, with a note (UsageError where neither can be had)."""
    spec = registry.resolve(name)
    copy, reason = headers.header_copy(spec)
    if copy is not None:
        return copy
    if spec.shape is None:
        raise UsageError(f"cannot plan {name} before its download: {reason}")
    try:
        copy = shapes.shape_copy(spec.name, spec.shape, spec.quant)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot plan {name} before its download: {reason}; nor from its published shape ({e})") from None
    notes.append(f"{name} is planned from the shape the registry states for it, not its file's header, "
                 "which could not be fetched: weights within a few percent")
    return copy


def _model_size(name: str, path: Path | None) -> offload.ModelSize:
    if path is None:
        raise UsageError(f"{name} is not on this machine, so its layers cannot be planned: run `specrun pull {name}`")
    return _read_model_size(path)


@once_per_version(maxsize=8)
def _read_model_size(path: Path) -> offload.ModelSize:
    """The planner's view of a model file, read once per file version (a plan with a profile
    check plans twice; reading a large vocabulary takes seconds)."""
    return placement.model_size(path)
