"""Logits -> the target's sampling distribution, and seeded draws from it.

`target_probs` is the one definition of "the target's distribution": plain decoding
(`choose_token`) and speculative verification (`verify.accept_path`) both go through it, so both
sample exactly the same thing. `log_softmax_topk` serves the draft tree builder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from specrun.errors import UsageError

# Top-k over a long row: take the maxima of groups of this many tokens, keep the k best groups,
# and select among their members only (a row's k best tokens lie in its k best groups).
_TOPK_GROUP = 64

# Top-p looks for its nucleus among this many best tokens first and widens the search only when
# their mass falls short, so a 262k-vocabulary row is partitioned instead of fully sorted.
_NUCLEUS_FIRST_GUESS = 1024
_NUCLEUS_GROWTH = 16

# draw() walks the CDF in blocks of this many tokens: a cumulative sum over 512 block sums and
# one block instead of over the whole vocabulary.
_DRAW_BLOCK = 512

# The OpenAI API's limit on top_logprobs.
MAX_TOP_LOGPROBS = 20

# A greedy token chosen over a runner-up less than this far behind it (in nats: the gap between
# their log-probs, which is the gap between their logits, on the row the choice was made from) is
# a near-tie, and the answer says so (docs/exactness.md). llama.cpp's kernels round differently
# with the number of tokens a pass holds: one position's log-probs moved by up to ~5e-3 between a
# tree pass and a one-token pass of the same text, so the gap between two of them by up to ~1e-2,
# and a gap below that can flip with the shape of the pass. 0.02 covers that twice over.
NEAR_TIE_NATS = 0.02
# On a GPU (CUDA, an H100: scripts/batch_invariance_probe.py over random-weight F32, F16, Q8_0 and
# Q4_K_M models) every pass of 2 tokens or more rounds otherwise than a one-token pass, by up to
# 0.39 in a logit, and choices flipped at gaps up to 0.059 (0.021 in speculative runs):
# 0.12 covers that twice over, where the target computes on a GPU or an RPC worker.
NEAR_TIE_NATS_OFFLOADED = 0.12


def near_tie_nats(offloaded: bool) -> float:
    """Return the near-tie threshold for a target computed on this CPU (False) or on a GPU or an
    RPC worker's device (True: their kernels part further between pass sizes)."""
    return NEAR_TIE_NATS_OFFLOADED if offloaded else NEAR_TIE_NATS

# log_softmax_topk exponentiates a logit matrix in row blocks of about this many elements, so a
# 2048 x 262144 matrix needs a 32 MB scratch buffer rather than a 2 GB temporary.
_LSE_BLOCK_ELEMENTS = 1 << 23


@dataclass(frozen=True)
class SamplingParams:
    """How the target picks a token: greedy at temperature 0, else a sample after the filters."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None  # None = fresh entropy
    # What the generated text itself changes (core/rules.py applies them, along each path):
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated text
    repeat_penalty: float = 1.0  # llama.cpp's: divides (or multiplies, if negative) recent tokens' logits
    repeat_last_n: int = 64  # how many recent generated tokens repeat_penalty looks at
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    grammar: Any = None  # a compiled grammar (engine.grammar.Grammar): only what it allows is drawn
    logprobs: int | None = None  # report log-probs: None off, else this many alternatives too
    # --reproducible: decoded as a seeded sample is (see reproducible), greedy requests too.
    pinned: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UsageError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise UsageError(f"top-k must be a whole number >= 0 (0 turns it off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top-p must be in (0, 1] (1 turns it off), got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise UsageError(f"min-p must be in [0, 1] (0 turns it off), got {self.min_p}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise UsageError(f"seed must be a whole number >= 0, got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise UsageError(f"{name.replace('_', '-')} must be in [-2, 2] (0 turns it off), got {value}")
        if not (math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0):
            raise UsageError(f"repeat-penalty must be > 0 (1 turns it off), got {self.repeat_penalty}")
        if not _is_int(self.repeat_last_n) or self.repeat_last_n < 0:
            raise UsageError(f"repeat-last-n must be a whole number >= 0, got {self.repeat_last_n}")
        for token, bias in self.logit_bias:
            if not _is_int(token) or token < 0:
                raise UsageError(f"logit_bias keys must be token ids >= 0, got {token}")
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise UsageError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise UsageError(f"top logprobs must be a whole number in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        """True when decoding takes the most likely token (temperature 0)."""
        return self.temperature <= 0

    @property
    def shapes_logits(self) -> bool:
        """True when the generated text changes the logits (penalties, bias or a grammar)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repeat_penalty != 1
                    or self.logit_bias or self.grammar is not None)

    @property
    def exact_prefill(self) -> bool:
        """True for a greedy request: its prompt is evaluated as a prefill into an empty cache would
        evaluate it, whatever the cache held (where that costs less than a batch: see
        decoding.kv.CachedSequence.reusable), because a greedy answer follows any near-tie that
        a last digit flips. A seeded sample goes further: see reproducible."""
        return self.greedy

    @property
    def reproducible(self) -> bool:
        """True for a seeded sample, which must come out the same whatever ran before it, and for
        any request asked to be (`pinned`: --reproducible).

        Logits depend in their last digits on how they were computed (a prompt partly reused from
        the KV cache, a tree pass or a one-token pass), and over a long answer such a difference
        flips a draw now and then; a greedy answer follows a near-tie that a last digit flips.
        Speculation sizes its trees by measured times, so the shape of a pass follows the clock.
        So decoders answer such a request from a fresh prefill of the whole prompt with one-token
        steps, in passes of its own: the same computation every time, whatever the load, and for
        a greedy request plain decoding's answer bit for bit (docs/exactness.md)."""
        return self.pinned or (self.seed is not None and not self.greedy)


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def target_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Return the sampling distribution (float64, each row sums to 1) for one logit row or a matrix.

    The order is fixed and shared by every caller, and is llama.cpp's default sampler order, so
    the same settings mean the same distribution as in llama.cpp's own tools: on the plain
    softmax (temperature 1), top-k keeps the k most likely tokens; top-p keeps the smallest
    best-first set whose probability (after top-k) reaches top_p; min-p keeps tokens at least
    min_p times as likely as the best one; then temperature divides the survivors' logits.
    Tokens tied at a cut are kept together, so the result never depends on sort order. Greedy
    params give a one-hot on the first maximum, the token `choose_token` picks. Rows are
    processed together, but a 2-D input is converted to float64 whole: pass the few rows you
    need, not a tree's whole logit matrix.
    """
    x = np.asarray(logits)
    if x.ndim not in (1, 2) or x.shape[-1] == 0:
        raise ValueError(f"logits must be a non-empty row or matrix, got shape {x.shape}")
    rows = x.reshape(-1, x.shape[-1])
    if params.greedy:
        probs = np.zeros(rows.shape)
        probs[np.arange(len(rows)), rows.argmax(axis=1)] = 1.0
        return probs.reshape(x.shape)

    # Work in place on one float64 copy: fresh 2 MB temporaries cost more than the arithmetic.
    weights = rows.astype(np.float64)
    best = weights.max(axis=1, keepdims=True)
    if not np.isfinite(best).all():
        raise ValueError("every logit row needs a finite maximum")
    weights -= best
    shifted = weights.copy() if params.temperature != 1 else None
    np.exp(weights, out=weights)  # unnormalised probabilities; the best token weighs exactly 1

    floor = _surviving_floor(weights, params)
    keep = weights >= floor if floor.any() else None
    if shifted is not None:  # temperature last, on the survivors
        shifted /= params.temperature
        weights = np.exp(shifted, out=shifted)
    if keep is not None:
        np.multiply(weights, keep, out=weights)
    weights /= weights.sum(axis=1, keepdims=True)
    return weights.reshape(x.shape)


def _surviving_floor(weights: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Return per row (as a column) the smallest weight that top-k, top-p and min-p all keep."""
    n_rows, n_vocab = weights.shape
    floor = np.zeros((n_rows, 1))
    kept = None  # the top-k survivors' weights, best first
    if 0 < params.top_k < n_vocab:
        kept = np.sort(np.take_along_axis(weights, _top_k_ids(weights, params.top_k), axis=1))[:, ::-1]
        floor = kept[:, -1:]
    if params.top_p < 1:
        search_floor = np.maximum(floor, params.min_p)  # tokens below it cannot survive anyway
        floor = np.maximum(floor, _nucleus_floor(weights, params.top_p, kept, search_floor))
    # min-p after top-p: relative to the best token, which no filter removes, so it just cuts.
    return np.maximum(floor, params.min_p)


def _nucleus_floor(weights, top_p, kept, search_floor) -> np.ndarray:
    """Return per row the smallest weight in the nucleus (0 when it reaches below search_floor)."""
    n_rows, n_vocab = weights.shape
    if kept is not None:
        # After top-k the survivors are `kept` plus any tokens tied with the k-th; those ties sort
        # last, so they only add to the total mass.
        ties = (weights >= kept[:, -1:]).sum(axis=1, keepdims=True) - kept.shape[1]
        need = top_p * (kept.sum(axis=1, keepdims=True) + ties * kept[:, -1:])
        return _first_reaching(kept, need)
    need = top_p * weights.sum(axis=1, keepdims=True)
    n_candidates = int((weights >= search_floor).sum(axis=1).max())
    k = min(_NUCLEUS_FIRST_GUESS, n_candidates)
    while True:
        top = np.take_along_axis(weights, _top_k_ids(weights, k), axis=1) if k < n_vocab else weights
        top = np.sort(top, axis=1)[:, ::-1]
        floor = _first_reaching(top, need)
        if floor.all() or k >= n_candidates:
            return floor
        k = min(k * _NUCLEUS_GROWTH, n_candidates)


def _first_reaching(sorted_weights: np.ndarray, need: np.ndarray) -> np.ndarray:
    """Return per row the weight at which the best-first cumulative mass reaches `need` (else 0)."""
    reached = np.cumsum(sorted_weights, axis=1) >= need
    last = sorted_weights[np.arange(len(need)), reached.argmax(axis=1)]
    return np.where(reached.any(axis=1), last, 0.0)[:, None]


def _top_k_ids(x: np.ndarray, k: int) -> np.ndarray:
    """Return the ids of each row's k largest entries, [n_rows, k], in no particular order.

    Which of several entries tied with the k-th is returned is unspecified.
    """
    n_rows, n_vocab = x.shape
    n_groups = n_vocab // _TOPK_GROUP
    if k * _TOPK_GROUP * 8 > n_vocab:
        return np.argpartition(x, n_vocab - k, axis=1)[:, n_vocab - k:]
    # Group g holds tokens g, g + n_groups, g + 2 * n_groups, ...: a strided max is fast. Any
    # group holding one of the k largest entries has a maximum among the k largest group maxima.
    body = n_groups * _TOPK_GROUP
    group_max = x[:, :body].reshape(n_rows, _TOPK_GROUP, n_groups).max(axis=1)
    groups = np.argpartition(group_max, n_groups - k, axis=1)[:, n_groups - k:]
    members = groups[:, :, None] + n_groups * np.arange(_TOPK_GROUP)
    tail = np.broadcast_to(np.arange(body, n_vocab), (n_rows, n_vocab - body))
    candidates = np.concatenate([members.reshape(n_rows, -1), tail], axis=1)
    values = np.take_along_axis(x, candidates, axis=1)
    best = np.argpartition(values, values.shape[1] - k, axis=1)[:, values.shape[1] - k:]
    return np.take_along_axis(candidates, best, axis=1)


def make_rng(seed: int | None) -> np.random.Generator:
    """Return the random generator for one generation (seeded: reproducible)."""
    return np.random.default_rng(seed)


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Return a token id drawn from `probs` by inverse CDF, using exactly one uniform from `rng`.

    One uniform per emitted token is why speculative sampling with a given seed emits the same
    tokens as plain sampling with that seed.
    """
    probs = np.asarray(probs)
    body = len(probs) // _DRAW_BLOCK * _DRAW_BLOCK
    block_mass = np.append(probs[:body].reshape(-1, _DRAW_BLOCK).sum(axis=1), probs[body:].sum())
    block_cdf = np.cumsum(block_mass)
    u = rng.random() * block_cdf[-1]
    # side="right": a block or token without mass is never chosen.
    block = int(np.searchsorted(block_cdf, u, side="right"))
    if block == len(block_cdf):  # u rounded up to the total: the last block with mass
        block = int(np.flatnonzero(block_mass)[-1])
    start = block * _DRAW_BLOCK
    in_block = probs[start : start + _DRAW_BLOCK]
    u -= block_cdf[block - 1] if block else 0.0
    cdf = np.cumsum(in_block)
    token = int(np.searchsorted(cdf, u, side="right"))
    if token == len(cdf):  # rounding left u at or past the block's total: its last token with mass
        token = int(np.flatnonzero(in_block)[-1])
    return start + token


def choose_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Return the target's next token for one logit row: the argmax if greedy, else a sample."""
    if params.greedy:
        return int(np.argmax(logits))  # first maximum on ties, like llama.cpp's greedy sampler
    return draw(target_probs(logits, params), rng)


@dataclass(frozen=True)
class NearTie:
    """A greedy choice whose runner-up trailed it by less than the near-tie threshold (near_tie_nats)."""

    at: int  # the token's index: in its step's tokens (decoding.steps.Step), in the answer (GenerationStats)
    token: int  # the token chosen (the row's first maximum)
    runner_up: int  # the best of the others
    gap: float  # nats: the chosen token's logit minus the runner-up's, >= 0


def near_tie(row: np.ndarray, token: int, at: int = 0, nats: float = NEAR_TIE_NATS) -> NearTie | None:
    """Return the near-tie at which greedy decoding chose `token` from `row` (its first maximum,
    as `choose_token` picks it), or None where the runner-up trails by `nats` or more
    (near_tie_nats: where the target computes).

    `row` is the row the choice was made from: after penalties, logit_bias and a grammar's mask.
    One pass over the row, without a copy: the best token before `token` and the best after it.
    """
    runner_up, second = -1, -math.inf
    if token > 0:
        runner_up = int(np.argmax(row[:token]))
        second = float(row[runner_up])
    if token + 1 < len(row):
        after = token + 1 + int(np.argmax(row[token + 1:]))
        if float(row[after]) > second:  # equal: the lower id, as argmax would rank them
            runner_up, second = after, float(row[after])
    gap = float(row[token]) - second
    if runner_up < 0 or not gap < nats:  # (a grammar that allows one token: an infinite gap)
        return None
    return NearTie(at, int(token), runner_up, gap)


def log_softmax_topk(logits_2d: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Return (ids, logprobs), both [n_rows, k]: each row's k likeliest tokens, best first.

    Log-probs are float64 under the plain (unfiltered, temperature 1) softmax; equal logits are
    ordered by lower id (which of several tied with the k-th is kept is unspecified). k larger
    than the vocabulary is clamped to it.
    """
    x = np.asarray(logits_2d)
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"logits must be a non-empty matrix, got shape {x.shape}")
    if not _is_int(k) or k < 1:
        raise ValueError(f"k must be a whole number >= 1, got {k}")
    n_rows, n_vocab = x.shape
    if k == 1:  # chains: argmax picks the lowest id among equal maxima, as promised above
        ids = x.argmax(axis=1)[:, None]
        values = np.take_along_axis(x, ids, axis=1).astype(np.float64)
        return ids, values - _logsumexp_rows(x, values)
    ids = _top_k_ids(x, min(int(k), n_vocab))
    values = np.take_along_axis(x, ids, axis=1)
    order = np.lexsort((ids, -values), axis=1)
    ids = np.take_along_axis(ids, order, axis=1)
    values = np.take_along_axis(values, order, axis=1).astype(np.float64)
    return ids, values - _logsumexp_rows(x, values[:, :1])


def _logsumexp_rows(x: np.ndarray, row_max: np.ndarray) -> np.ndarray:
    """Return log(sum(exp(x))) per row as a float64 column, given each row's maximum."""
    n_rows, n_vocab = x.shape
    block = max(1, min(n_rows, _LSE_BLOCK_ELEMENTS // n_vocab))
    scratch = np.empty((block, n_vocab), dtype=np.result_type(x.dtype, np.float32))
    totals = np.empty(n_rows)
    for start in range(0, n_rows, block):
        stop = min(start + block, n_rows)
        buf = scratch[: stop - start]
        np.subtract(x[start:stop], row_max[start:stop].astype(buf.dtype), out=buf)
        np.exp(buf, out=buf)
        totals[start:stop] = buf.sum(axis=1)
    return row_max + np.log(totals)[:, None]


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the model, and the likeliest alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-prob), best first


def token_logprobs(rows: np.ndarray, tokens, n_top: int) -> list[TokenLogprob]:
    """Return, for each row and the token drawn from it, log-probs under the model's own softmax.

    This is the raw distribution (temperature 1, before penalties, bias, grammar and the filters),
    as the OpenAI API and llama.cpp's server report it: the same numbers whatever the sampling
    settings, and whether the row came from a plain step or a verified tree node.
    """
    x = np.asarray(rows)
    if x.ndim == 1:
        x = x[None, :]
    tokens = np.asarray(tokens, np.int64)
    lse = _logsumexp_rows(x, x.max(axis=1, keepdims=True).astype(np.float64))[:, 0]
    chosen = x[np.arange(len(tokens)), tokens].astype(np.float64) - lse
    if n_top:
        ids, lps = log_softmax_topk(x, n_top)
        tops = [tuple(zip(i.tolist(), lp.tolist())) for i, lp in zip(ids, lps)]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(int(t), float(lp), top) for t, lp, top in zip(tokens.tolist(), chosen.tolist(), tops)]
