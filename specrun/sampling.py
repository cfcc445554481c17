"""Logits -> the target's sampling distribution, and seeded draws from it.

`target_probs` is the one definition of "the target's distribution": plain decoding
(`choose_token`) and speculative verification (`verify.accept_path`) both go through it, so both
sample exactly the same thing. `log_softmax_topk` serves the draft tree builder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from specrun.errors import UsageError

# Top-p looks for its nucleus among this many best tokens first and widens the search only when
# their mass falls short, so a 262k-vocabulary row is partitioned instead of fully sorted.
_NUCLEUS_FIRST_GUESS = 1024
_NUCLEUS_GROWTH = 16

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

    @property
    def greedy(self) -> bool:
        """True when decoding takes the most likely token (temperature 0)."""
        return self.temperature <= 0


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def target_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Return the sampling distribution (float64, each row sums to 1) for one logit row or a matrix.

    The order is fixed and shared by every caller: temperature divides the logits; top-k keeps
    the k highest; top-p keeps the smallest best-first set whose probability (after top-k)
    reaches top_p; min-p keeps tokens at least min_p times as likely as the best one. Tokens tied
    at any cut are kept together, so the result never depends on sort order. Greedy params give
    a one-hot on the first maximum, the token `choose_token` picks. Rows are processed together,
    but a 2-D input is converted to float64 whole: pass the few rows you need, not a tree's
    logit matrix.
    """
    x = np.asarray(logits)
    if x.ndim not in (1, 2) or x.shape[-1] == 0:
        raise ValueError(f"logits must be a non-empty row or matrix, got shape {x.shape}")
    rows = x.reshape(-1, x.shape[-1])
    n_rows, n_vocab = rows.shape
    if params.greedy:
        probs = np.zeros(rows.shape)
        probs[np.arange(n_rows), rows.argmax(axis=1)] = 1.0
        return probs.reshape(x.shape)

    z = rows.astype(np.float64) / params.temperature
    best = z.max(axis=1, keepdims=True)
    if not np.isfinite(best).all():
        raise ValueError("every logit row needs a finite maximum")
    weights = np.exp(z - best)  # unnormalised; the best token has weight 1

    floor = np.full((n_rows, 1), -np.inf)  # per row: the lowest logit that survives
    if 0 < params.top_k < n_vocab:
        floor = np.partition(z, n_vocab - params.top_k, axis=1)[:, n_vocab - params.top_k, None]
        weights[z < floor] = 0.0
    if params.min_p > 0:
        # Relative to the best token, which no filter removes, so min-p commutes with top-p.
        floor = np.maximum(floor, best + math.log(params.min_p))
    if params.top_p < 1:
        need = params.top_p * weights.sum(axis=1, keepdims=True)
        floor = np.maximum(floor, _nucleus_floor(z, best, floor, need))

    probs = np.where(z >= floor, weights, 0.0)
    probs /= probs.sum(axis=1, keepdims=True)
    return probs.reshape(x.shape)


def _nucleus_floor(z: np.ndarray, best: np.ndarray, floor: np.ndarray, need: np.ndarray) -> np.ndarray:
    """Return per row the lowest logit top-p keeps among tokens >= floor (-inf: keep them all)."""
    n_rows, n_vocab = z.shape
    # Only tokens above the top-k/min-p floor can matter: the nucleus is a best-first prefix, so
    # its cumulative masses are known from those tokens alone.
    n_candidates = int((z >= floor).sum(axis=1).max())
    k = min(_NUCLEUS_FIRST_GUESS, n_candidates)
    while True:
        top = np.partition(z, n_vocab - k, axis=1)[:, n_vocab - k:] if k < n_vocab else z
        top = np.sort(top, axis=1)[:, ::-1]
        mass = np.where(top >= floor, np.exp(top - best), 0.0)
        reached = np.cumsum(mass, axis=1) >= need
        found = reached.any(axis=1)
        if found.all() or k >= n_candidates:
            break
        k = min(k * _NUCLEUS_GROWTH, n_candidates)
    last = top[np.arange(n_rows), reached.argmax(axis=1)]
    return np.where(found, last, -np.inf)[:, None]


def make_rng(seed: int | None) -> np.random.Generator:
    """Return the random generator for one generation (seeded: reproducible)."""
    return np.random.default_rng(seed)


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Return a token id drawn from `probs` by inverse CDF, using exactly one uniform from `rng`.

    One uniform per emitted token is why speculative sampling with a given seed emits the same
    tokens as plain sampling with that seed.
    """
    cdf = np.cumsum(probs)
    u = rng.random() * cdf[-1]
    token = int(np.searchsorted(cdf, u, side="right"))  # "right": zero-mass tokens never win
    if token == len(cdf):  # u rounded up to the total
        token = int(np.flatnonzero(probs)[-1])
    return token


def choose_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Return the target's next token for one logit row: the argmax if greedy, else a sample."""
    if params.greedy:
        return int(np.argmax(logits))  # first maximum on ties, like llama.cpp's greedy sampler
    return draw(target_probs(logits, params), rng)


def log_softmax_topk(logits_2d: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Return (ids, logprobs), both [n_rows, k]: each row's k likeliest tokens, best first.

    Log-probs are float64 under the plain (unfiltered, temperature 1) softmax; equal logits are
    ordered by lower id. k larger than the vocabulary is clamped to it.
    """
    x = np.asarray(logits_2d)
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"logits must be a non-empty matrix, got shape {x.shape}")
    if not _is_int(k) or k < 1:
        raise ValueError(f"k must be a whole number >= 1, got {k}")
    n_rows, n_vocab = x.shape
    k = min(int(k), n_vocab)
    ids = np.argpartition(x, n_vocab - k, axis=1)[:, n_vocab - k:]
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
