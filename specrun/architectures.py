"""Which llama.cpp architectures keep a recurrent state, and how each can speculate: the one table.

Attention models drop rejected draft tokens by removing their KV cells, so a whole draft tree is
verified in one pass. A recurrent state (Mamba, RWKV, Gated DeltaNet, short convolutions) cannot
be cut back to an earlier position: llama.cpp rolls it back only for the architectures in
`llm_arch_supports_rs_rollback` (src/llama-arch.cpp), by up to `n_rs_seq` tokens of the last
decode, once per step. Those verify chains (each the pending token + drafts in a sequence of its
own; the accepted one's rejected tail is rolled back in that sequence); the rest decode plainly. The lists are the vendored llama.cpp's
(src/llama-arch.cpp `llm_arch_is_recurrent`, `llm_arch_is_hybrid`, `llm_arch_supports_rs_rollback`).
"""

from __future__ import annotations

from dataclasses import dataclass

RECURRENT = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
HYBRID = frozenset({
    "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe",
    "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next", "qwen35", "qwen35moe", "qwen4exp",
    "deepseek4", "minimax-01",
})
ROLLBACK = frozenset({
    "kimi-k3", "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "glm5-next", "nemotron_h", "nemotron_h_moe",
    "lfm2", "lfm2moe", "bailingmoe3",
})

# Not standalone models: heads loaded beside their target (Gemma 4's MTP assistants).
HEADS = frozenset({"gemma4-assistant"})

# Whether specrun drafts with MTP heads (`--draft mtp`, and by default for a target that carries
# them): engine.mtp drives them from Python (load_mtp, an MTP context, the target's nextn rows
# through C++ staging symbols the binding lacks), decoding/drafters/mtp.py proposes the chains.
MTP_DRAFTING = True

# The speculative shapes, most capable first: one tree (shared prefixes), several independent
# chains of equal length, one chain, none.
TREE, CHAINS, CHAIN, PLAIN = "tree", "chains", "chain", "plain"


@dataclass(frozen=True)
class Support:
    """How a target of one architecture can verify drafts: `shape` and the one-line reason."""

    shape: str  # "tree", "chains", "chain" or "plain"
    reason: str


def is_recurrent(arch: str) -> bool:
    """Return whether the architecture keeps only a recurrent state (no attention KV cache)."""
    return arch in RECURRENT


def is_hybrid(arch: str) -> bool:
    """Return whether the architecture mixes attention layers with recurrent ones."""
    return arch in HYBRID


def has_state(arch: str) -> bool:
    """Return whether the architecture keeps a recurrent state (pure recurrent or hybrid)."""
    return arch in RECURRENT or arch in HYBRID


def can_roll_back(arch: str) -> bool:
    """Return whether llama.cpp can roll the architecture's recurrent state back (n_rs_seq)."""
    return arch in ROLLBACK


def speculation_support(arch: str) -> Support:
    """Return the most capable speculative shape a target of `arch` verifies exactly, and why."""
    if arch in ROLLBACK:
        return Support(CHAINS, f"{arch} keeps a recurrent state that llama.cpp rolls back only in the sequence "
                               "that made it: drafts are verified as independent chains, not as one tree")
    if arch in HYBRID:
        return Support(PLAIN, f"{arch} keeps a recurrent state that llama.cpp cannot roll back: "
                              "rejected drafts could not be undone, so it decodes plainly")
    if arch in RECURRENT:
        return Support(PLAIN, f"{arch} is a recurrent model whose state llama.cpp cannot roll back: "
                              "rejected drafts could not be undone, so it decodes plainly")
    return Support(TREE, f"{arch} keeps an attention KV cache: rejected branches are dropped, whole draft trees are verified")


@dataclass(frozen=True)
class Speculation:
    """How a model speculates (what `specrun models` says of each entry before any download):
    mode is "tree", "chains", "plain" or "unknown", with the reason."""

    mode: str
    reason: str
    mtp: bool = False  # the file carries MTP layers

    @property
    def label(self) -> str:
        """The short form `specrun models` shows: "tree", "chains", "plain only", "chains, MTP"..."""
        text = {"plain": "plain only", "unknown": "?"}.get(self.mode, self.mode)
        return f"{text}, MTP" if self.mtp and self.mode != "unknown" else text

    def as_dict(self) -> dict:
        return {"mode": self.mode, "reason": self.reason, "mtp": self.mtp, "mtp_drafting": self.mtp and MTP_DRAFTING}


def speculation(arch: str | None, mtp: bool = False) -> Speculation:
    """Return how a model of this architecture (GGUF `general.architecture`) can speculate."""
    if not arch:
        return Speculation("unknown", "architecture not known until the file is loaded", mtp)
    arch = arch.lower()
    if arch in HEADS:
        return Speculation("plain", f"{arch} is a drafting head, not a standalone model", mtp)
    support = speculation_support(arch)  # what the plan itself will verify with
    return Speculation(support.shape, support.reason, mtp)
