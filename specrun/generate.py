"""Decoding loops and the text stream on top of them.

Layers, from the bottom: a decoder's `steps()` yields `Step`s (the token ids the target committed
in one forward pass, with timings); `stream()` turns steps into `Chunk`s of text, applying stop
strings and the token limit; `generate()` collects a whole answer. Plain decoding lives here and
is the baseline every speedup is measured against; speculative decoding (speculative.py) yields
the same kind of steps, so everything above the step level is shared.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence

import numpy as np

from specrun.errors import ContextFullError, UsageError
from specrun.sampling import SamplingParams, choose_token, make_rng


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
    def tokens_per_s(self) -> float:
        return self.n_generated / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def accepted_per_pass(self) -> float:
        return self.n_generated / self.n_passes if self.n_passes else 0.0

    def total(self, attr: str) -> float:
        return float(sum(getattr(s, attr) for s in self.steps))

    def as_dict(self) -> dict:
        target_s, draft_s, overhead_s = self.total("target_s"), self.total("draft_s"), self.total("overhead_s")
        return {
            "n_prompt": self.n_prompt,
            "n_prefilled": self.n_prefilled,
            "n_tokens": self.n_generated,
            "n_passes": self.n_passes,
            "tokens_per_s": round(self.tokens_per_s, 3),
            "accepted_per_pass": round(self.accepted_per_pass, 3),
            "prefill_s": round(self.prefill_s, 4),
            "decode_s": round(self.decode_s, 4),
            "target_s": round(target_s, 4),
            "draft_s": round(draft_s, 4),
            "overhead_s": round(overhead_s, 4),
            "mean_tree_nodes": round(float(np.mean([s.tree_nodes for s in self.steps])), 2) if self.steps else 0.0,
            "finish_reason": self.finish_reason,
        }


class Decoder(Protocol):
    """Anything that turns a prompt into a stream of committed target tokens."""

    stats: GenerationStats
    eog: frozenset[int]

    def steps(self, prompt: Sequence[int], params: SamplingParams, max_tokens: int, rng: np.random.Generator) -> Iterator[Step]: ...


class CachedSequence:
    """Tracks the tokens held in sequence 0 of a context's KV cache and reuses them across calls.

    The last token of a prompt is kept out of the cache: it is the "pending" token the next
    forward pass starts from (for speculation, the root of the first tree).
    """

    def __init__(self, ctx, batch):
        self.ctx = ctx
        self.batch = batch
        self.tokens: list[int] = []

    @property
    def n_cached(self) -> int:
        return len(self.tokens)

    def sync(self, prompt: Sequence[int], include_last: bool = False) -> tuple[int, int, float]:
        """Make the cache hold prompt[:-1]; return (pending token, tokens prefilled, seconds).

        With include_last the last token is decoded too (in the same batch as the rest of the new
        tokens), and its logits are left in the context.
        """
        if not prompt:
            raise UsageError("the prompt is empty (no tokens to start from)")
        if len(prompt) >= self.ctx.n_ctx:
            raise ContextFullError(
                f"the prompt has {len(prompt)} tokens but the context holds {self.ctx.n_ctx}; "
                "use a larger --ctx-size or a shorter prompt"
            )
        keep = 0
        limit = min(len(self.tokens), len(prompt) - 1)
        while keep < limit and self.tokens[keep] == prompt[keep]:
            keep += 1
        t0 = time.perf_counter()
        self.truncate(keep)
        todo = list(prompt[keep:]) if include_last else list(prompt[keep:-1])
        self.extend(todo, want_last_logits=include_last)
        return prompt[-1], len(todo), time.perf_counter() - t0

    def truncate(self, n: int) -> None:
        """Drop everything from position n on, in every sequence."""
        self.ctx.seq_rm(-1, n, -1)
        del self.tokens[n:]

    def extend(self, tokens: Sequence[int], want_last_logits: bool = False) -> None:
        """Decode tokens into sequence 0 in chunks of n_batch."""
        step = self.batch.capacity
        for start in range(0, len(tokens), step):
            chunk = tokens[start : start + step]
            last = start + step >= len(tokens)
            self.batch.set_sequence(chunk, self.n_cached, 0, "last" if (want_last_logits and last) else "none")
            self.ctx.decode(self.batch)
            self.tokens.extend(chunk)

    def room(self) -> int:
        """Return how many more tokens fit in the context."""
        return self.ctx.n_ctx - self.n_cached


class PlainDecoder:
    """Autoregressive decoding: one target forward pass per token. The baseline."""

    def __init__(self, model, ctx):
        from specrun.engine import Batch

        self.model = model
        self.ctx = ctx
        self.cache = CachedSequence(ctx, Batch(ctx.n_batch, 1))
        self._one = Batch(1, 1)
        self.eog = model.eog_tokens
        self.stats = GenerationStats()

    def steps(self, prompt: Sequence[int], params: SamplingParams, max_tokens: int, rng: np.random.Generator) -> Iterator[Step]:
        self.stats = stats = GenerationStats(n_prompt=len(prompt))
        # The whole new part of the prompt goes in one batch, as llama.cpp's own tools do, and its
        # last row gives the first token.
        pending, stats.n_prefilled, stats.prefill_s = self.cache.sync(prompt, include_last=True)
        one, ctx, cache = self._one, self.ctx, self.cache
        logits = ctx.logits_row(-1)
        for i in range(max_tokens):
            t0 = time.perf_counter()
            if i:
                if cache.room() < 1:
                    stats.finish_reason = "context"
                    return
                one.set_arrays([pending], [cache.n_cached], [0], True)
                ctx.decode(one)
                cache.tokens.append(pending)
                logits = ctx.logits_row(-1)
            t1 = time.perf_counter()
            token = choose_token(logits, params, rng)
            step = Step([token], target_s=t1 - t0, total_s=time.perf_counter() - t0)
            stats.steps.append(step)
            stats.n_generated += 1
            stats.decode_s += step.total_s
            yield step
            if token in self.eog:
                stats.finish_reason = "eog"
                return
            pending = token
        stats.finish_reason = "length"


# --------------------------------------------------------------------------------------------
# Text stream


@dataclass
class Chunk:
    """A piece of streamed output."""

    text: str
    tokens: list[int]
    finish_reason: str | None = None


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Return how many trailing characters of text could still start a stop string."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return hold


def stream(
    decoder: Decoder,
    model,
    prompt: Sequence[int],
    params: SamplingParams,
    max_tokens: int = 256,
    stop: Sequence[str] = (),
) -> Iterator[Chunk]:
    """Yield text chunks as the target commits tokens; the last chunk carries finish_reason."""
    from specrun.engine import Detokenizer

    if max_tokens < 1:
        raise UsageError("max tokens must be at least 1")
    stops = [s for s in stop if s]
    detok = Detokenizer(model)
    rng = make_rng(params.seed)
    pending_text = ""
    for step in decoder.steps(prompt, params, max_tokens, rng):
        pending_text += detok.feed_many(t for t in step.tokens if t not in decoder.eog)
        if stops:
            cut = min((i for i in (pending_text.find(s) for s in stops) if i >= 0), default=-1)
            if cut >= 0:
                decoder.stats.finish_reason = "stop"
                yield Chunk(pending_text[:cut], step.tokens, "stop")
                return
            hold = _held_back(pending_text, stops)
        else:
            hold = 0
        out, pending_text = pending_text[: len(pending_text) - hold], pending_text[len(pending_text) - hold :]
        yield Chunk(out, step.tokens)
    pending_text += detok.flush()
    yield Chunk(pending_text, [], decoder.stats.finish_reason or "length")


@dataclass
class Result:
    """A finished generation: text, generated token ids, stats."""

    text: str
    tokens: list[int]
    stats: GenerationStats


def generate(decoder: Decoder, model, prompt: Sequence[int], params: SamplingParams, max_tokens: int = 256, stop: Sequence[str] = ()) -> Result:
    """Return the whole generation at once."""
    texts: list[str] = []
    tokens: list[int] = []
    for chunk in stream(decoder, model, prompt, params, max_tokens, stop):
        texts.append(chunk.text)
        tokens.extend(chunk.tokens)
    return Result("".join(texts), tokens, decoder.stats)


def token_ids(decoder: Decoder, prompt: Sequence[int], params: SamplingParams, max_tokens: int, seed: int | None = None) -> list[int]:
    """Return just the generated token ids (for tests and benchmarks)."""
    rng = make_rng(seed if seed is not None else params.seed)
    out: list[int] = []
    for step in decoder.steps(prompt, params, max_tokens, rng):
        out.extend(step.tokens)
    return out
