"""Which llama.cpp architectures keep a recurrent state, and how each can speculate.

Attention models drop rejected draft tokens by removing their KV cells, so a whole draft tree is
verified in one pass. A recurrent state (Mamba, RWKV, Gated DeltaNet, short convolutions) cannot
be cut back to an earlier position: llama.cpp rolls it back only for the architectures in
`llm_arch_supports_rs_rollback` (src/llama-arch.cpp), by up to `n_rs_seq` tokens of the last
decode, once per step. Those verify a chain (the pending token + the drafts in one sequence, the
rejected tail rolled back); the rest decode plainly. The lists are the vendored llama.cpp's
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

# The speculative shapes, most capable first.
TREE, CHAIN, PLAIN = "tree", "chain", "plain"


@dataclass(frozen=True)
class Support:
    """How a target of one architecture can verify drafts: `shape` and the one-line reason."""

    shape: str  # "tree", "chain" or "plain"
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
        return Support(CHAIN, f"{arch} keeps a recurrent state that llama.cpp rolls back only along one "
                              "sequence: drafts are verified as a chain")
    if arch in HYBRID:
        return Support(PLAIN, f"{arch} keeps a recurrent state that llama.cpp cannot roll back: "
                              "rejected drafts could not be undone, so it decodes plainly")
    if arch in RECURRENT:
        return Support(PLAIN, f"{arch} is a recurrent model whose state llama.cpp cannot roll back: "
                              "rejected drafts could not be undone, so it decodes plainly")
    return Support(TREE, "attention KV cache: rejected branches are dropped, whole draft trees are verified")
