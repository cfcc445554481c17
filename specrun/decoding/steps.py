"""What decoders yield: one `Step` per target forward pass, and the stats of a generation.

Every decoder (plain or speculative, whatever the drafter) yields the same kind of steps, so
everything above the step level (text streams, chat, the server, the tuner) is shared.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator, Protocol, Sequence

import numpy as np

from specrun.core.sampling import NearTie, SamplingParams, TokenLogprob


@dataclass
class Step:
    """What one target forward pass committed."""

    tokens: list[int]
    target_s: float = 0.0
    draft_s: float = 0.0
    total_s: float = 0.0
    tree_nodes: int = 0
    tree_depth: int = 0
    tree_leaves: int = 0
    draft_passes: int = 0
    reused_nodes: int = 0  # tree nodes drafted while the target's pass before ran (drafter.extend)
    accepted: int = 0  # tree tokens the target accepted (the bonus token not counted)
    lookup_tokens: int = 0  # of those, how many came from text lookup rather than the draft model
    forced_tokens: int = 0  # of those, how many a grammar forced (free drafts: nobody proposed them)
    shared: int = 1  # requests whose tokens the step's target pass held (decoding.batching; 1: this one's alone)
    # The first step of a generation: its token comes from the prompt's last row, whose pass is the
    # prefill's (prefill_s), so its time is the draw's alone and says nothing of decoding speed.
    from_prompt: bool = False
    # Greedy: the tokens chosen at a near-tie (core.sampling.near_tie; `at`: index in `tokens`).
    near_ties: tuple[NearTie, ...] = ()
    # One per token when the request asked for log-probs (params.logprobs), else None.
    logprobs: list[TokenLogprob] | None = None
    # Calibration data for the tuner: best-first rank of each accepted tree node, and for each
    # node the walk visited, the rank among its children of the child the target chose (0: none).
    path_ranks: tuple[int, ...] = ()
    child_ranks: tuple[int, ...] = ()

    @property
    def overhead_s(self) -> float:
        """Time spent outside llama_decode (Python, numpy, KV bookkeeping)."""
        return max(0.0, self.total_s - self.target_s - self.draft_s)


@dataclass
class GenerationStats:
    """Summary of one generation: counts, timings, acceptance."""

    n_prompt: int = 0
    n_prefilled: int = 0
    n_generated: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str | None = None
    steps: list[Step] = field(default_factory=list)

    @property
    def n_passes(self) -> int:
        return len(self.steps)

    @property
    def tokens_per_s(self) -> float | None:
        """Return the decoding speed: the tokens that decoding passes wrote over the time they took
        (the first token comes from the prompt's pass, timed as prefill: counted with it, a
        one-token answer ran at tens of thousands of tokens/s); None where no decoding pass wrote one
        (an answer of one token or none)."""
        n_tokens, seconds = self.decoded
        return n_tokens / seconds if n_tokens and seconds > 0 else None

    @property
    def decoded(self) -> tuple[int, float]:
        """(tokens, seconds) of the decoding passes: the first token, from the prompt's pass, left out."""
        decoded = [step for step in self.steps if not step.from_prompt]
        return sum(len(step.tokens) for step in decoded), sum(step.total_s for step in decoded)

    @property
    def accepted_per_pass(self) -> float:
        return self.n_generated / self.n_passes if self.n_passes else 0.0

    @property
    def near_ties(self) -> list[NearTie]:
        """Return the greedy choices made at a near-tie, each `at` its token's index in the answer."""
        ties, n_before = [], 0
        for step in self.steps:
            ties.extend(replace(tie, at=n_before + tie.at) for tie in step.near_ties)
            n_before += len(step.tokens)
        return ties

    def total(self, attr: str) -> float:
        return float(sum(getattr(s, attr) for s in self.steps))

    def as_dict(self) -> dict:
        target_s, draft_s, overhead_s = self.total("target_s"), self.total("draft_s"), self.total("overhead_s")
        rate = self.tokens_per_s
        return {
            "n_prompt": self.n_prompt,
            "n_prefilled": self.n_prefilled,
            "n_tokens": self.n_generated,
            "n_passes": self.n_passes,
            "tokens_per_s": None if rate is None else round(rate, 3),
            "accepted_per_pass": round(self.accepted_per_pass, 3),
            "lookup_tokens": int(self.total("lookup_tokens")),
            "forced_tokens": int(self.total("forced_tokens")),
            "draft_tokens": int(self.total("accepted") - self.total("lookup_tokens") - self.total("forced_tokens")),
            "prefill_s": round(self.prefill_s, 4),
            "decode_s": round(self.decode_s, 4),
            "target_s": round(target_s, 4),
            "draft_s": round(draft_s, 4),
            "overhead_s": round(overhead_s, 4),
            "mean_tree_nodes": round(float(np.mean([s.tree_nodes for s in self.steps])), 2) if self.steps else 0.0,
            "max_tree_nodes": max((s.tree_nodes for s in self.steps), default=0),
            # tree nodes the draft model grew while the target's pass before ran elsewhere
            "reused_nodes": int(self.total("reused_nodes")),
            # passes that also held other requests' tokens (several decoding at once)
            "shared_passes": sum(1 for s in self.steps if s.shared > 1),
            # greedy tokens chosen at a near-tie, which a pass of another shape may choose otherwise
            "near_ties": sum(len(s.near_ties) for s in self.steps),
            "finish_reason": self.finish_reason,
        }


class Decoder(Protocol):
    """Anything that turns a prompt into a stream of committed target tokens."""

    stats: GenerationStats
    eog: frozenset[int]

    def reset(self) -> None: ...

    def steps(self, prompt: Sequence[int], params: SamplingParams, max_tokens: int, rng: np.random.Generator) -> Iterator[Step]: ...
