"""How a model can speculate, from its architecture (GGUF `general.architecture`).

A pure table of llama.cpp's facts (src/llama-arch.cpp of the pinned sources), so `specrun models`
can say what each registry entry will do before anything is downloaded:

- attention-only models verify a whole draft tree in one batch ("tree");
- hybrids whose recurrent state keeps rollback snapshots (`llm_arch_supports_rs_rollback`) can
  drop the rejected tail of a verify batch, by at most the tokens of the last decode: they verify
  a chain ("chain") until trees are shown exact on the recurrent memory's equal-split ubatches;
- other hybrids and pure recurrent models cannot drop part of a sequence: plain decoding ("plain").

MTP layers (next-token-prediction heads) are reported beside the mode; whether specrun drafts
with them is `MTP_DRAFTING`.
"""

from __future__ import annotations

from dataclasses import dataclass

from specrun import architectures

# The sets are llama.cpp's facts, kept once in specrun.architectures (what the plan verifies with).
ROLLBACK_HYBRIDS = architectures.ROLLBACK
FIXED_HYBRIDS = architectures.HYBRID - architectures.ROLLBACK  # their recurrent state cannot be cut back
RECURRENT = architectures.RECURRENT
# Not standalone models: heads loaded beside their target (Gemma 4's MTP assistants).
HEADS = frozenset({"gemma4-assistant"})

# Whether specrun drafts with MTP heads (`--draft mtp`). The pinned library allows it from Python
# (scripts/mtp_probe.py drives a head exactly: load_mtp, an MTP context, the target's nextn rows
# through C++ staging symbols the binding lacks), but no decoder uses it yet.
MTP_DRAFTING = False


@dataclass(frozen=True)
class Speculation:
    """How a model speculates: mode is "tree", "chain", "plain" or "unknown", with the reason."""

    mode: str
    reason: str
    mtp: bool = False  # the file carries MTP layers

    @property
    def label(self) -> str:
        """The short form `specrun models` shows: "tree", "chain", "plain only", "chain, MTP"..."""
        text = {"plain": "plain only", "unknown": "?"}.get(self.mode, self.mode)
        return f"{text}, MTP" if self.mtp and self.mode != "unknown" else text

    def as_dict(self) -> dict:
        return {"mode": self.mode, "reason": self.reason, "mtp": self.mtp, "mtp_drafting": self.mtp and MTP_DRAFTING}


def speculation(arch: str | None, mtp: bool = False) -> Speculation:
    """Return how a model of this architecture can speculate as a target or a draft."""
    if not arch:
        return Speculation("unknown", "architecture not known until the file is loaded", mtp)
    arch = arch.lower()
    if arch in HEADS:
        return Speculation("plain", f"{arch} is a drafting head, not a standalone model", mtp)
    if arch in RECURRENT:
        return Speculation("plain", f"{arch} is recurrent: its state cannot roll back rejected drafts", mtp)
    if arch in FIXED_HYBRIDS:
        return Speculation("plain", f"{arch} is a hybrid whose recurrent state cannot roll back", mtp)
    if arch in ROLLBACK_HYBRIDS:
        return Speculation(
            "chain",
            f"{arch} is a hybrid: its recurrent state rolls back within one verify batch, so drafts are verified as a chain",
            mtp,
        )
    return Speculation("tree", f"{arch} keeps an attention cache: draft trees are verified in one batch", mtp)
