"""What a run is asked for: the options every command shares, and the model files they resolve to."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

DEFAULT_CTX = 4096
# `--draft lookup` names no model: trees come from earlier occurrences in the session's text.
LOOKUP = "lookup"
# `--draft mtp` names no model either: the target's own MTP layers draft (runtime.trees.MTP_CHAIN).
MTP = "mtp"


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
    # --rpc: the RPC workers ("HOST:PORT") whose devices take target layers beside this machine's
    rpc: tuple[str, ...] = ()
    # --parallel: requests decoding together (the server's); None: as many as fit, up to
    # plan.DEFAULT_PARALLEL, at the context one request gets
    parallel: int | None = 1
    # --throughput: with several requests decoding together, a prompt's passes also hold the
    # other requests' steps (as llama-server batches them), and any cached prefix of a prompt is
    # reused; an answer may part from the same request alone at a near-tie (docs/exactness.md)
    throughput: bool = False
    # --memory: the memory of answers (decoding.memory) is loaded from the cache folder at start
    # and saved there at the end, per target model; `memory_scope` keeps one apart (an API key:
    # hashed into the file's name, never shown)
    memory: bool = False
    memory_scope: str | None = field(default=None, repr=False)
    # --mmap / --no-mmap: map the target's file, or read it into memory (the layers left in RAM
    # then sit in the GPU's pinned host memory); None: as the plan decides (hardware.offload.target_mapped)
    mmap: bool | None = None
    # --head here/workers/auto: with --rpc, where the target's output layer computes: "here" keeps
    # it on this machine (hidden states cross the network, not a logits row per token); "workers":
    # llama.cpp's placement, with the last layers; None (auto): here where that measures faster
    head: str | None = None
    # --flash-attn on/off/auto: the target's attention (engine.Context); None: off on a batch-invariant
    # build, else llama.cpp's auto (on wherever its devices have the kernel, the CPU included)
    flash_attn: str | None = None
    # --kv-type f16/q8_0/q4_0: the target's KV cache cells (engine.Context); None: f16
    kv_type: str | None = None
    # --kv-split: with several requests decoding together, each its own cache in the target's
    # context (llama.cpp's kv_unified off), verifying chains: its cells stay in its own order
    kv_split: bool = False
    # serve --reproducible, generate --reproducible (but --jsonl, whose lines may say otherwise):
    # every request is decoded as a reproducible one, so nothing drafts unless the target's greedy
    # chains measure as its one-token passes (decoding.kv.chains_exact; the Runtime decides)
    reproducible: bool = False

    @property
    def head_here(self) -> bool | None:
        """--head as hardware.placement.plan takes it: True, False, or None to measure."""
        return {"here": True, "workers": False}.get(self.head)

    def plain(self) -> RunOptions:
        """These options decoding plainly: no draft model, lookup or MTP layers asked for."""
        return replace(self, no_spec=True, lookup=None, draft=None)

    def profile_options(self) -> dict:
        """The options a tuning profile is kept apart by (tuning.profiles.profile_key, load)."""
        return {"threads": self.threads, "gpu_memory": self.gpu_memory, "mmap": self.mmap, "flash_attn": self.flash_attn,
                "kv_type": self.kv_type, "head": self.head}

    def context_notes(self, parallel: int) -> list[str]:
        """What the target context's options cost here, said at start (Plan.notes)."""
        notes = []
        if self.flash_attn == "off" and parallel > 1:  # (docs/benchmarks.md, "Flash attention on a CPU")
            notes.append(f"--flash-attn off with {parallel} requests at once: a pass attends over every request's text in "
                         "the shared cache, masked cells included, which flash attention skips: slower once they hold long texts")
        if self.head == "here" and not self.rpc:
            notes.append("--head here without --rpc does nothing: the output layer computes on this machine already")
        if self.kv_split and parallel == 1:
            notes.append("--kv-split with one request at a time does nothing: that request has the cache to itself")
        return notes

    def target_context(self) -> dict:
        """What the options set of the target's context (runtime.plan.ContextPlan's fields)."""
        return {"flash_attn": self.flash_attn, "kv_type": self.kv_type, "split": self.kv_split}

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


def with_target_options(ctx, target: dict | None, parallel: int):
    """The target's context plan (runtime.plan.ContextPlan) with its options (RunOptions.target_context):
    a split cache (--kv-split) where several requests decode together holds one sequence for each."""
    target = dict(target or {})
    split = bool(target.pop("split", False)) and parallel > 1
    return replace(ctx, **target, split=split, **({"n_seq_max": parallel} if split else {}))
