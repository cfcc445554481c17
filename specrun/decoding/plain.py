"""Plain autoregressive decoding: one target forward pass per token, the baseline every speedup
is measured against."""

from __future__ import annotations

import time
from typing import Iterator, Sequence

import numpy as np

from specrun.core.rules import PathRules
from specrun.core.sampling import SamplingParams, choose_token, near_tie, near_tie_nats, token_logprobs
from specrun.decoding.batching import Lane
from specrun.decoding.kv import CachedSequence
from specrun.decoding.steps import GenerationStats, Step
from specrun.engine import Batch


class PlainDecoder:
    """Autoregressive decoding: one target forward pass per token. The baseline."""

    def __init__(self, model, ctx, lane: Lane | None = None):
        """`lane`: the request's share of the context when several requests decode together
        (decoding.batching); by default all of it."""
        self.model = model
        self.ctx = ctx
        self.tie_nats = near_tie_nats(ctx.model.offloaded)
        self.cache = CachedSequence(ctx, Batch(ctx.n_batch, 1), lane)
        self.lane = self.cache.lane
        self._one = Batch(1, 1)
        self.eog = model.eog_tokens
        self.stats = GenerationStats()

    def reset(self) -> None:
        """Forget the KV cache (after an interrupted step left it in an unknown state)."""
        self.cache.clear()

    def steps(self, prompt: Sequence[int], params: SamplingParams, max_tokens: int, rng: np.random.Generator) -> Iterator[Step]:
        self.stats = stats = GenerationStats(n_prompt=len(prompt))
        if params.reproducible:
            self.cache.truncate(0)
        # The new part of the prompt goes in as few batches as the batch grid allows (kv.py), and
        # the last row gives the first token.
        pending, stats.n_prefilled, stats.prefill_s = self.cache.sync(prompt, include_last=True, keep_row=True,
                                                                       exact=params.exact_prefill, joins=self.cache.joins(params))
        one, cache = self._one, self.cache
        rules = PathRules.of(params)
        logits = cache.logits
        for i in range(max_tokens):
            t0 = time.perf_counter()
            if i:
                if cache.room() < 1:
                    stats.finish_reason = "context"
                    return
                one.set_arrays([pending], [cache.n_cached], [cache.seq], True)
                logits = self.lane.run(one, solo=params.reproducible)[-1]
                cache.tokens.append(pending)
            t1 = time.perf_counter()
            row = logits if rules is None else rules.shape(logits)
            token = choose_token(row, params, rng)
            if rules is not None:
                rules.accept(token)
            tie = near_tie(row, token, nats=self.tie_nats) if params.greedy else None
            # llama.cpp's time for the pass, not the wait for other requests' batches
            step = Step([token], target_s=self.lane.pass_s if i else t1 - t0,
                        total_s=time.perf_counter() - t0, shared=self.lane.shared if i else 1, from_prompt=not i)
            if tie is not None:
                step.near_ties = (tie,)
            if params.logprobs is not None:
                step.logprobs = token_logprobs(logits, [token], params.logprobs)
            stats.steps.append(step)
            stats.n_generated += 1
            stats.decode_s += step.total_s
            yield step
            if token in self.eog:
                stats.finish_reason = "eog"
                return
            pending = token
        stats.finish_reason = "length"

