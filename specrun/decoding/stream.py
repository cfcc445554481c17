"""Text on top of decoder steps: stop strings, the token limit, whole results.

`stream()` turns a decoder's steps into `Chunk`s of text, applying stop strings and the token
limit; `generate()` collects a whole answer; `token_ids()` just the ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

from specrun.core.sampling import SamplingParams, TokenLogprob, make_rng
from specrun.decoding.steps import Decoder, GenerationStats
from specrun.engine import Detokenizer
from specrun.errors import UsageError


@dataclass
class Chunk:
    """A piece of streamed output."""

    text: str
    tokens: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when the params asked for them
    # The generation's figures so far (complete on the last chunk; stream() sets them on every
    # chunk): what a reader reports, read from the chunks it got, never from the decoder, which
    # the next request may have taken.
    stats: GenerationStats | None = None


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
    """Yield text chunks as the target commits tokens; the last chunk carries finish_reason, every
    chunk the generation's stats."""
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
                yield Chunk(pending_text[:cut], step.tokens, "stop", step.logprobs, decoder.stats)
                return
            hold = _held_back(pending_text, stops)
        else:
            hold = 0
        out, pending_text = pending_text[: len(pending_text) - hold], pending_text[len(pending_text) - hold :]
        yield Chunk(out, step.tokens, logprobs=step.logprobs, stats=decoder.stats)
    pending_text += detok.flush()
    yield Chunk(pending_text, [], decoder.stats.finish_reason or "length", stats=decoder.stats)


@dataclass
class Result:
    """A finished generation: text, generated token ids, stats."""

    text: str
    tokens: list[int]
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per token in `tokens`, when asked for


def generate(decoder: Decoder, model, prompt: Sequence[int], params: SamplingParams, max_tokens: int = 256, stop: Sequence[str] = ()) -> Result:
    """Return the whole generation at once."""
    return collect(stream(decoder, model, prompt, params, max_tokens, stop), params)


def collect(chunks, params: SamplingParams, on_text=None) -> Result:
    """Return the Result of a stream of chunks, calling on_text(text) for each as it comes."""
    texts: list[str] = []
    tokens: list[int] = []
    logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
    stats = None
    for chunk in chunks:
        stats = chunk.stats
        if on_text is not None:
            on_text(chunk.text)
        texts.append(chunk.text)
        tokens.extend(chunk.tokens)
        if logprobs is not None and chunk.logprobs:
            logprobs.extend(chunk.logprobs)
    return Result("".join(texts), tokens, stats, logprobs)


def token_ids(decoder: Decoder, prompt: Sequence[int], params: SamplingParams, max_tokens: int, seed: int | None = None) -> list[int]:
    """Return just the generated token ids (for tests and benchmarks)."""
    rng = make_rng(seed if seed is not None else params.seed)
    out: list[int] = []
    for step in decoder.steps(prompt, params, max_tokens, rng):
        out.extend(step.tokens)
    return out
