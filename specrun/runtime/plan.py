"""One plan before anything loads: files, drafter, tree, contexts, GPU layers and memory.

`build_plan(opts)` decides everything a run needs, in this order, and nothing later changes it:

1. the model files (registry aliases resolved; missing files fetched unless `fetch=False`);
2. the drafter and its tree: explicit --budget/--depth > the stored tuning profile > the default
   chain; or plain decoding (no draft, --no-spec, or --no-lookup with a profile that measured the
   draft model's trees slower than plain decoding: without --no-lookup such a profile leaves
   lookup alone on). `--draft lookup` drafts from the session's text alone (no draft model);
   lookup branches join the draft model's trees by default (hybrid); `--draft mtp` drafts chains
   with the target's own MTP layers, and a target that carries them drafts so when no --draft
   is given;
3. the contexts: n_ctx, and n_batch = n_ubatch large enough for the largest tree + its root in
   one pass (a tree split over ubatches pays the weight transfer again when offloading);
4. GPU layers for the target and the draft, planned for exactly that n_ubatch (the compute
   buffer grows with it), and the memory expected on each device and in RAM.

`Runtime(plan)` loads exactly this; `specrun plan` prints it without loading any weights.

A plan made from a tuning profile carries one check (`Plan.check`): the profile's figures hold
for the machine as it was when tuned. At load the target's one-token pass is timed; where it is
off the profile's by more than PROFILE_DRIFT (a laptop on battery, another power state, a busy
machine), the run loads `check.fallback` instead: the plan made as without a profile, whose
drafter times both models itself. It is offered only where it loads the target the same way.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from specrun import architectures, engine, ui
from specrun.core.shapes import MAX_BUDGET, TreeShape, TreeTemplate, template_shape
from specrun.decoding.adaptive import DraftPrior
from specrun.errors import UsageError
from specrun.hardware import offload, placement
from specrun.limits import MAX_SEQ
from specrun.models import hub, pairing, registry
from specrun.tuning import profiles
from specrun.tuning.cost_model import Choice

log = logging.getLogger("specrun")

DEFAULT_CTX = 4096
# Used when no tuning profile exists: a short chain (classic speculative decoding), which pays
# wherever the draft is much cheaper than the target, even on a CPU where wide trees cost dearly.
DEFAULT_SHAPE = TreeShape.chain(5)
# Prompts are prefilled in batches of this many tokens.
PREFILL_BATCH = 512
# `--draft lookup` names no model: trees come from earlier occurrences in the session's text.
LOOKUP = "lookup"
# The largest lookup tree a step may verify (the drafter adapts below it to what pays): deep
# enough for a long verbatim copy, wide enough for a few different continuations.
LOOKUP_SHAPE = TreeShape(budget=64, depth=32, width=1, top_k=1)
# `--draft mtp` names no model either: the target's own MTP layers draft a chain per step, this
# long by default (llama.cpp's draft-mtp default; --depth or --budget sets it).
MTP = "mtp"
MTP_CHAIN = 3
# How far the target's one-token pass at load may be from the tuning profile's (either way, as a
# fraction) before the profile's figures are set aside for the run. The pass timed at load and
# plain decoding's passes agree within about 5% in one state of a machine; a CPU in another power
# state is 15-50% off, and on the 2-core test host the demo pair's draft went from losing (10.8 ms
# target passes) to paying 1.1x (12 ms). Set aside, a run is the untuned default: never slower.
PROFILE_DRIFT = 0.08


@dataclass(frozen=True)
class RunOptions:
    """Options shared by chat, generate, bench, tune, plan and serve."""

    target: str | None = None
    draft: str | None = None
    gpu_layers: int | None = None
    ctx_size: int | None = DEFAULT_CTX  # None: the model's trained context, as far as memory holds it
    threads: int | None = None
    budget: int | None = None
    depth: int | None = None
    no_spec: bool = False
    # Add lookup branches to the draft model's trees (hybrid drafting). None: the default, on
    # wherever a draft model runs (measured no slower than its trees alone on free text, and
    # about twice as fast on text that repeats: see README); False: --no-lookup.
    lookup: bool | None = None
    quiet: bool = False  # no download progress bars
    # --gpu-memory: use at most this many bytes of each GPU (a big card stands in for a smaller one)
    gpu_memory: int | None = None

    @property
    def lookup_only(self) -> bool:
        """Whether --draft lookup: lookup trees and no draft model."""
        return is_lookup(self.draft)

    @property
    def mtp_only(self) -> bool:
        """Whether --draft mtp: the target's MTP layers draft, no draft model."""
        return self.draft is not None and self.draft.strip().lower() == MTP


def is_lookup(draft: str | None) -> bool:
    """Whether a --draft value asks for the draft-free lookup drafter."""
    return draft is not None and draft.strip().lower() == LOOKUP


@dataclass(frozen=True)
class ModelFiles:
    """The resolved target and draft: alias (or path) and local file."""

    target_name: str
    target_path: Path | None  # None: not downloaded yet (only when planning without fetching)
    draft_name: str | None
    draft_path: Path | None
    # The target's own MTP layers draft (--draft mtp, or a target that carries them and no --draft).
    mtp: bool = False
    mtp_why: str = ""


@dataclass(frozen=True)
class TreePlan:
    """The tree a speculative run grows, and why this one."""

    shape: TreeShape  # the draft model's tree (lookup only: the largest lookup tree)
    template: TreeTemplate | None  # a tuned Sequoia tree, grown as is (None: best-first growth)
    source: str  # "flags", "profile" or "default"
    lookup: TreeShape | None = None  # lookup nodes a step may add (None: no lookup)
    draft_model: bool = True  # False: lookup alone proposes, no draft model is loaded
    plain_s: float | None = None  # plain decoding's seconds per token by the tuning profile
    # How the target verifies: "tree" (attention KV cache) or "chains" (a recurrent state that
    # rolls back only in the sequence that made it: each step checks the proposal's best paths,
    # each in a sequence of its own).
    verify: str = architectures.TREE
    prior: DraftPrior | None = None  # the profile's figures for the draft model (hybrid's first steps)
    mtp: bool = False  # the target's MTP layers draft a chain of `shape.depth` (draft_model is False)

    @property
    def drafter(self) -> str:
        """"draft model", "sequoia" (static, draft model), "lookup" (no model), "hybrid" or "mtp"."""
        if self.mtp:
            return "mtp"
        if not self.draft_model:
            return "lookup"
        if self.lookup is not None:
            return "hybrid"
        return "sequoia" if self.template is not None else "draft model"

    @property
    def kind(self) -> str:
        if self.mtp:
            return "mtp"
        if not self.draft_model:
            return "lookup"
        if self.template is not None:
            return "sequoia"
        return "chain" if self.shape.is_chain else "specexec"

    @property
    def verified(self) -> TreeShape:
        """The largest tree one target pass verifies: the draft model's plus lookup branches."""
        if self.lookup is None or not self.draft_model:
            return self.shape
        return replace(self.shape, budget=min(MAX_BUDGET, self.shape.budget + self.lookup.budget),
                       depth=max(self.shape.depth, self.lookup.depth))

    def describe(self) -> str:
        text = self._describe_drafts()
        if self.verify == architectures.CHAINS:
            text += f"; the target verifies up to {MAX_CHAINS} chains of up to {self.verified.depth} drafts per step"
        return text

    def _describe_drafts(self) -> str:
        s = self.shape
        if self.mtp:
            return f"chain of {s.depth} drafts from the target's own MTP layers (no draft model)"
        if not self.draft_model:
            return f"lookup trees of up to {s.budget} tokens from the session's text, depth {s.depth} (no draft model)"
        if self.template is not None:
            text = f"Sequoia static tree of {s.budget} draft tokens, depth {s.depth}"
        elif s.is_chain:
            text = f"chain of {s.budget} draft tokens"
        else:
            text = f"best-first tree of {s.budget} draft tokens, depth {s.depth}, width {s.width}, top-k {s.top_k}"
        if self.lookup is not None:
            text += f" + up to {self.lookup.budget} lookup tokens from the session's text"
        return text


@dataclass(frozen=True)
class ContextPlan:
    """llama.cpp context sizes: cells, batch = ubatch (tokens per forward pass), sequences."""

    n_ctx: int
    n_batch: int
    n_seq_max: int
    n_rs_seq: int = 0  # recurrent-state snapshots per sequence (rollback of a verified chain)

    @property
    def n_ubatch(self) -> int:
        return self.n_batch  # the engine sets n_ubatch = n_batch: one pass per batch


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

    @property
    def drafter(self) -> str:
        """Which drafter proposes trees: "draft model", "sequoia", "lookup", "hybrid", "mtp" or "none"."""
        return "none" if self.tree is None else self.tree.drafter

    @property
    def draft_loaded(self) -> bool:
        """Whether a draft model is loaded (speculating, and not with lookup alone)."""
        return self.tree is not None and self.tree.draft_model

    @property
    def target_gpu_layers(self) -> int:
        return self.placement.target_gpu_layers

    @property
    def draft_gpu_layers(self) -> int:
        p = self.placement
        return p.draft_gpu_layers if p.draft_device is not None else 0

    def to_dict(self) -> dict:
        f = self.files
        tree = None
        if self.tree is not None:
            s = self.tree.shape
            tree = {"kind": self.tree.kind, "verify": self.tree.verify, "source": self.tree.source, "budget": s.budget, "depth": s.depth,
                    "width": s.width, "top_k": s.top_k, "text": self.tree.describe(),
                    "lookup_budget": self.tree.lookup.budget if self.tree.lookup else 0,
                    "verified_budget": self.tree.verified.budget}
        return {
            "target": {"name": f.target_name, "path": _path(f.target_path), "gpu_layers": self.target_gpu_layers,
                       "layer_slots": self.placement.target_n_slots},
            "draft": None if f.draft_name is None or not self.draft_loaded else {
                "name": f.draft_name, "path": _path(f.draft_path), "gpu_layers": self.draft_gpu_layers,
                "device": (self.devices[self.placement.draft_device].name
                           if self.placement.draft_device is not None else "RAM"),
            },
            "drafter": self.drafter,
            "tree": tree,
            "why": self.why,
            "contexts": {
                "target": _ctx_dict(self.target_ctx),
                "draft": _ctx_dict(self.draft_ctx) if self.draft_ctx else None,
            },
            "context": {"n_ctx": self.target_ctx.n_ctx, "why": self.ctx_why, "n_ctx_train": self.n_ctx_train or None},
            "threads": self.threads,
            "memory": {
                "devices": [
                    {"name": d.name, "planned_bytes": used, "free_bytes": d.free_bytes, "limit_bytes": limit}
                    for d, used, limit in zip(self.devices, self.placement.device_bytes,
                                              self.placement.device_limit_bytes)
                ],
                "ram": {"planned_bytes": self.placement.ram_bytes, "limit_bytes": self.placement.ram_limit_bytes},
                "fits": self.placement.fits,
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
        """Whether a one-token pass timed now is within PROFILE_DRIFT of the profile's, either way."""
        return abs(math.log(target_pass_s / self.pass_s)) <= math.log1p(PROFILE_DRIFT)

    def describe(self) -> str:
        fallback = self.fallback
        otherwise = f"{fallback.drafter}: {fallback.tree.describe()}" if fallback.tree else "plain decoding"
        return (f"at load the target's one-token pass is timed; more than {PROFILE_DRIFT:.0%} off the profile's "
                f"{self.pass_s * 1e3:.1f} ms, the run decides as without the profile ({otherwise})")


def _path(path: Path | None) -> str | None:
    return str(path) if path is not None else None


def _ctx_dict(ctx: ContextPlan) -> dict:
    return {"n_ctx": ctx.n_ctx, "n_batch": ctx.n_batch, "n_ubatch": ctx.n_ubatch, "n_seq_max": ctx.n_seq_max,
            "n_rs_seq": ctx.n_rs_seq}


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
    if devices is None:
        devices = engine.list_devices()
    return _build(opts, files, shape, devices, ram_free_bytes, sizes, detailed, use_profile=True)


def _build(opts: RunOptions, files: ModelFiles, shape: TreeShape | None, devices: list,
           ram_free_bytes: int | None, sizes, detailed: bool, use_profile: bool) -> Plan:
    """Return the plan for resolved files (build_plan's arguments); `use_profile=False` decides
    as without a tuning profile: the plan a profile's check falls back to."""
    pass_s = None
    if shape is not None:
        tree, why, untuned = TreePlan(shape, None, "flags"), "tree given by the caller", False
    else:
        tree, why, untuned, pass_s = choose_tree(opts, files, use_profile)
    notes = []
    target_arch = engine.gguf_architecture(files.target_path) if files.target_path is not None else None
    draft_arch = engine.gguf_architecture(files.draft_path) if files.draft_path is not None else None
    if tree is not None and target_arch is not None:
        tree, why, note = fit_tree_to_target(tree, why, target_arch)
        if note:
            notes.append(note)
    if tree is not None and tree.template is not None and draft_arch and architectures.has_state(draft_arch):
        # A draft with a recurrent state has one sequence per tree node (its context keeps few):
        # it grows best-first trees of the template's size rather than the static template.
        tree = replace(tree, template=None)
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
    draft_path = files.draft_path if tree is not None and tree.draft_model else None
    auto_ctx = opts.ctx_size is None
    target_size = draft_size = None
    if gpus or sizes is not None or detailed or auto_ctx:
        target_size = sizes[0] if sizes else _model_size(files.target_name, files.target_path)
        if draft_path is not None or (sizes and tree is not None and tree.draft_model):
            draft_size = sizes[1] if sizes else _model_size(files.draft_name, draft_path)
    if auto_ctx:
        widest = max(PREFILL_BATCH, tree.verified.budget + 1 if tree is not None else 0)
        n_ctx, ctx_why = placement.largest_context(target_size, draft_size, gpus, widest, opts.gpu_layers,
                                                   ram_free_bytes)
    else:
        n_ctx, ctx_why = opts.ctx_size, "--ctx-size"
    if tree is not None and tree.verified.budget + 1 > n_ctx:
        # A tree and its root must fit the context in one pass (llama.cpp caps n_batch at n_ctx).
        notes.append(f"a tree of {tree.verified.budget} tokens does not fit a {n_ctx}-token context: "
                     f"using {n_ctx - 1}")
        tree = _fit_tree(tree, n_ctx - 1)
    draft_ctx = None
    if tree is not None:
        tree_tokens = tree.verified.budget + 1
        if tree.verify in (architectures.CHAINS, architectures.CHAIN):
            # A sequence per chain (MTP drafts one), and snapshots to roll the state back by the
            # rejected drafts.
            n_chains = MAX_CHAINS if tree.verify == architectures.CHAINS else 1
            chain_tokens = n_chains * (tree.verified.depth + 1)
            target_ctx = ContextPlan(n_ctx, min(n_ctx, max(PREFILL_BATCH, chain_tokens)), n_chains, tree.verified.depth)
        else:
            target_ctx = ContextPlan(n_ctx, min(n_ctx, max(PREFILL_BATCH, tree_tokens)), MAX_SEQ)
        if tree.draft_model:
            # A draft with a recurrent state keeps one state per tree sequence: only as many as
            # its tree has nodes (each node's state is its parent's, copied, plus its token).
            seqs = min(MAX_SEQ, tree.shape.budget + 1) if draft_arch and architectures.has_state(draft_arch) else MAX_SEQ
            draft_ctx = ContextPlan(n_ctx, min(n_ctx, PREFILL_BATCH), seqs)
    else:
        target_ctx = ContextPlan(n_ctx, min(n_ctx, PREFILL_BATCH), 1)
    if target_size is None:
        placed = placement.cpu_only([p for p in (files.target_path, draft_path) if p is not None], ram_free_bytes)
    else:
        placed = placement.plan(
            target_size, draft_size, gpus, n_ctx, target_ctx.n_ubatch, override=opts.gpu_layers,
            ram_free_bytes=ram_free_bytes,
        )
    plan = Plan(
        files=files, tree=tree, why=why, target_ctx=target_ctx, draft_ctx=draft_ctx,
        threads=threads, placement=placed, devices=gpus, untuned=untuned,
        notes=tuple(notes), ctx_why=ctx_why, n_ctx_train=target_size.n_ctx_train if target_size else 0,
    )
    if pass_s is not None:
        fallback = _build(opts, files, None, devices, ram_free_bytes, sizes, detailed, use_profile=False)
        if fallback.placement.fits and _loads_target_alike(plan, fallback):
            plan = replace(plan, check=ProfileCheck(pass_s, fallback))
    return plan


def _loads_target_alike(plan: Plan, other: Plan) -> bool:
    """Whether two plans load the target the same way (layers, devices, context, threads): the
    second can then be loaded after the first's target was, once the target's pass is timed."""
    a, b = plan.placement, other.placement
    return ((a.target_gpu_layers, a.target_tensor_split, a.op_offload, plan.target_ctx, plan.threads)
            == (b.target_gpu_layers, b.target_tensor_split, b.op_offload, other.target_ctx, other.threads))


# The longest chain a target with a recurrent state verifies per step: llama.cpp keeps one state
# snapshot per draft token (memory: the recurrent state times this), and chains gain little beyond.
MAX_CHAIN = 8
# Chains per step: each holds a recurrent state and its snapshots (memory: times this).
MAX_CHAINS = 4


def fit_tree_to_target(tree: TreePlan, why: str, arch: str) -> tuple[TreePlan | None, str, str | None]:
    """Return (the tree the target's architecture can verify exactly or None, why, a note or None).

    Attention targets verify trees as planned. Targets whose recurrent state rolls back verify
    chains: trees no deeper than MAX_CHAIN whose best paths (up to MAX_CHAINS) are scored each in
    a sequence of its own.
    Targets whose state cannot roll back decode plainly, said in one line.
    """
    support = architectures.speculation_support(arch)
    if support.shape == architectures.TREE:
        return tree, why, None
    if support.shape == architectures.PLAIN:
        return None, support.reason, f"plain decoding: {support.reason}"
    if tree.mtp:
        shape = TreeShape.chain(min(MAX_CHAIN, tree.shape.depth))
        return replace(tree, shape=shape, verify=architectures.CHAIN), f"{why}; {support.reason}", None
    depth = min(MAX_CHAIN, tree.verified.depth)
    s = tree.shape
    shape = TreeShape(min(s.budget, MAX_CHAINS * depth), min(s.depth, depth), s.width, s.top_k)
    lookup = TreeShape(MAX_CHAINS * depth, depth, 1, 1) if tree.lookup is not None else None
    if not tree.draft_model:
        shape = lookup
    chained = replace(tree, shape=shape, template=None, lookup=lookup, verify=architectures.CHAINS)
    return chained, f"{why}; {support.reason}", None


def _fit_tree(tree: TreePlan, budget: int) -> TreePlan:
    """Return the tree cut to `budget` verified nodes: lookup branches give way first."""
    if tree.lookup is not None and tree.draft_model and tree.shape.budget < budget:
        return replace(tree, lookup=tree.lookup.resized(budget - tree.shape.budget))
    shape = tree.shape.resized(budget)
    lookup = shape if not tree.draft_model and not tree.mtp else None
    return replace(tree, shape=shape, template=None, lookup=lookup)


def _model_size(name: str, path: Path | None) -> offload.ModelSize:
    if path is None:
        raise UsageError(f"{name} is not on this machine, so its layers cannot be planned: run `specrun pull {name}`")
    stat = path.stat()
    return _read_model_size(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_model_size(path: str, size: int, mtime_ns: int) -> offload.ModelSize:
    """The planner's view of a model file, read once per file version (a plan with a profile
    check plans twice; reading a large vocabulary takes seconds)."""
    return placement.model_size(Path(path))


def resolve_models(opts: RunOptions, fetch: bool = True) -> ModelFiles:
    """Return the target's and draft's local paths, fetching what is missing (after saying what).

    With fetch=False nothing is downloaded: a missing model's path is None.
    """
    if opts.target is None:
        target_name, default_draft = registry.default_pair()
    else:
        target_name, default_draft = opts.target, None
    target_spec = registry.resolve(target_name)
    draft_spec = None
    if opts.no_spec and (opts.lookup is True or opts.lookup_only or opts.mtp_only):
        raise UsageError("--no-spec decodes without drafting: it does not go with --lookup, --draft lookup or --draft mtp")
    # A target that carries MTP layers drafts with them unless a draft model is named (the file
    # says so once on disk; the registry's `mtp = true` before the download).
    target_path = None
    target_has_mtp = target_spec.mtp
    if opts.draft is None and not opts.no_spec:
        target_path = _local_path(target_spec, opts.quiet, fetch)
        target_has_mtp = has_mtp_layers(target_spec, target_path)
    auto_mtp = opts.draft is None and not opts.no_spec and opts.lookup is not True and target_has_mtp
    if not opts.no_spec and not opts.lookup_only and not opts.mtp_only and not auto_mtp:
        if opts.draft is not None:
            draft_spec = registry.resolve(opts.draft)
        elif default_draft is not None and opts.target is None:
            draft_spec = registry.resolve(default_draft)
        else:
            draft_spec = registry.recommended_draft(target_spec)
        if draft_spec is not None:
            pairing.check_pair(target_spec, draft_spec)
    if target_path is None:
        target_path = _local_path(target_spec, opts.quiet, fetch)
    draft_path = _local_path(draft_spec, opts.quiet, fetch) if draft_spec is not None else None
    mtp_why = ""
    if opts.mtp_only:
        if not has_mtp_layers(target_spec, target_path):
            raise UsageError(f"--draft mtp: {target_spec.name} has no MTP layers (llama.cpp's nextn layers); "
                             "pass a draft model, --draft lookup, or a file that keeps them (the *-mtp registry entries)")
        mtp_why = "--draft mtp: the target's own MTP layers draft"
    elif auto_mtp:
        mtp_why = (f"{target_spec.name} carries MTP layers and no draft model was given: they draft "
                   "(--draft MODEL or --draft lookup to choose otherwise)")
    return ModelFiles(target_spec.name, target_path, draft_spec.name if draft_spec else None, draft_path,
                      mtp=bool(mtp_why), mtp_why=mtp_why)


def has_mtp_layers(spec, path: Path | None) -> bool:
    """Whether the target carries MTP layers: its file's header says, else the registry's `mtp`."""
    if path is not None:
        return engine.gguf_has_mtp_layers(path)
    return bool(spec.mtp)


def _local_path(spec, quiet: bool, fetch: bool) -> Path | None:
    """Return the model's local path; a missing model is announced (what, how big) and fetched."""
    if not fetch:
        return Path(hub.ensure_local(spec, progress=False, allow_download=False)) if hub.is_present(spec) else None
    missing = hub.describe_missing(spec)
    if missing and not quiet:
        ui.info(f"pulling {missing}...")
    return Path(hub.ensure_local(spec, progress=not quiet, console=ui.err_console()))


def choose_tree(opts: RunOptions, files: ModelFiles,
                use_profile: bool = True) -> tuple[TreePlan | None, str, bool, float | None]:
    """Return (the tree or None for plain decoding, why, whether the pair is untuned, the
    target's one-token pass by the profile that decided, if one did and timed it).

    `--draft lookup`: lookup trees alone. Otherwise explicit --budget/--depth win; else the stored
    tuning profile; else the default chain. Lookup branches join the draft model's tree unless
    --no-lookup. A profile that measured the draft model's trees slower than plain decoding
    turns off the draft model only: lookup alone runs (plain decoding only with --no-lookup).
    With an explicit `--lookup` lookup also stands alone where there is no draft model. The
    profile's figures (`prior`) decide the hybrid's first steps in a fresh process.
    `use_profile=False`: as without a profile.
    """
    if opts.lookup_only:
        return _lookup_tree(opts, None), "--draft lookup: trees from the session's text, no draft model", False, None
    if files.mtp:
        return _mtp_tree(opts), files.mtp_why, False, None
    if files.draft_name is None:
        if opts.lookup is True:
            why = f"--lookup without a draft model for {files.target_name}: lookup alone"
            return _lookup_tree(opts, None), why, False, None
        why = "--no-spec" if opts.no_spec else f"no draft model for {files.target_name} (pass --draft)"
        return None, why, False, None
    choice = facts = None
    if use_profile and files.target_path is not None and files.draft_path is not None:
        choice = profiles.choice_for(files.target_path, files.draft_path, opts.threads, opts.gpu_memory)
        facts = profiles.facts_for(files.target_path, files.draft_path, opts.threads, opts.gpu_memory) if choice else None
    pass_s = facts.pass_s if facts is not None and 0 < (facts.pass_s or 0) < math.inf else None
    plain_s = None
    if choice is not None and choice.predicted_tokens_per_s > 0:
        plain_s = choice.predicted_speedup / choice.predicted_tokens_per_s  # tokens/s / speedup = plain's
    overridden = opts.budget is not None or opts.depth is not None
    if choice is not None and choice.kind == "plain" and not overridden:
        # The profile measured the draft model's trees slower than plain decoding here. That says
        # nothing about lookup, which costs no draft pass and sizes its trees online (plain steps
        # where it has nothing that pays): it stays on unless --no-lookup.
        why = "the tuning profile measured the draft model's trees slower than plain decoding here"
        if opts.lookup is False:
            return None, why + " (--no-lookup: plain decoding)", False, pass_s
        return _lookup_tree(opts, plain_s), why + ": lookup alone, sized online", False, pass_s
    tuned = tree_of_choice(choice) if choice is not None else None
    if tuned is not None:
        tree, why = tuned, "tuned profile for this pair on this machine"
    else:
        tree, why = TreePlan(DEFAULT_SHAPE, None, "default"), "default (no tuning profile: `specrun tune` measures one)"
    if overridden:
        shape = tree.shape
        if opts.budget is not None:
            shape = shape.resized(opts.budget)
        if opts.depth is not None:
            shape = replace(shape, depth=opts.depth)
        # explicit sizes: grow best-first trees of that size, of the tuned (or default) kind
        tree, why = TreePlan(shape, None, "flags"), "--budget/--depth"
    tree = replace(tree, plain_s=plain_s, prior=facts.draft_prior(tree.shape) if facts is not None else None)
    if opts.lookup is True:
        tree, why = replace(tree, lookup=LOOKUP_SHAPE), why + "; --lookup adds branches from the session's text"
    elif opts.lookup is None:
        tree, why = replace(tree, lookup=LOOKUP_SHAPE), why + "; with lookup branches from the session's text (--no-lookup: without)"
    return tree, why, choice is None, pass_s


def _mtp_tree(opts: RunOptions) -> TreePlan:
    """Return the MTP chain: MTP_CHAIN drafts, or --depth (else --budget) of them."""
    depth = opts.depth or opts.budget
    shape = TreeShape.chain(depth or MTP_CHAIN)
    return TreePlan(shape, None, "flags" if depth else "default", draft_model=False, mtp=True)


def _lookup_tree(opts: RunOptions, plain_s: float | None) -> TreePlan:
    """Return lookup trees alone: LOOKUP_SHAPE, or the --budget/--depth given."""
    shape, source = LOOKUP_SHAPE, "default"
    if opts.budget is not None or opts.depth is not None:
        shape, source = TreeShape(opts.budget or shape.budget, opts.depth or shape.depth, 1, 1), "flags"
    return TreePlan(shape, None, source, lookup=shape, draft_model=False, plain_s=plain_s)


def tuned_default(choice: Choice, facts: profiles.Facts | None) -> TreePlan:
    """The tree a run without flags grows from a profile: the profile's tree with lookup branches
    (the profile's figures deciding the hybrid's first steps), or lookup alone where the profile
    measured the draft model's trees slower than plain decoding."""
    tree = tree_of_choice(choice)
    if tree is None:
        return TreePlan(LOOKUP_SHAPE, None, "profile", lookup=LOOKUP_SHAPE, draft_model=False)
    return replace(tree, lookup=LOOKUP_SHAPE, prior=facts.draft_prior(tree.shape) if facts is not None else None)


def tree_of_choice(choice: Choice) -> TreePlan | None:
    """Return the tree a tuner choice stands for (None for plain decoding)."""
    if choice.kind == "plain":
        return None
    if choice.kind == "sequoia" and choice.tree is not None:
        return TreePlan(template_shape(choice.tree), choice.tree, "profile")
    return TreePlan(TreeShape(choice.budget, choice.depth, choice.width, choice.top_k), None, "profile")
