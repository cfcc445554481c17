import math
from collections import Counter

import numpy as np
import pytest
from scipy import stats

from specrun.core.sampling import (
    SamplingParams,
    choose_token,
    draw,
    log_softmax_topk,
    make_rng,
    target_probs,
)
from specrun.errors import UsageError


def logits_of(probs):
    """Logits whose softmax is `probs` (zeros become -inf)."""
    with np.errstate(divide="ignore"):
        return np.log(np.asarray(probs, dtype=np.float64))


def normalised(weights):
    weights = np.asarray(weights, dtype=np.float64)
    return weights / weights.sum()


P = [0.05, 0.4, 0.1, 0.25, 0.2]  # ranks: 1 > 3 > 4 > 2 > 0


def probs_for(probs=P, **params):
    return target_probs(logits_of(probs), SamplingParams(temperature=1.0, **params))


def test_temperature_one_is_plain_softmax():
    np.testing.assert_allclose(probs_for(), P, rtol=1e-12)


def test_temperature_scales_logits():
    logits = np.array([1.0, 2.0, 4.0])
    for t in (0.5, 2.0):
        expected = normalised(np.exp(logits / t))
        np.testing.assert_allclose(target_probs(logits, SamplingParams(temperature=t)), expected, rtol=1e-12)


def test_top_k_keeps_k_best():
    np.testing.assert_allclose(probs_for(top_k=2), normalised([0, 0.4, 0, 0.25, 0]), rtol=1e-12)
    np.testing.assert_allclose(probs_for(top_k=1), [0, 1, 0, 0, 0])
    np.testing.assert_allclose(probs_for(top_k=5), P, rtol=1e-12)
    np.testing.assert_allclose(probs_for(top_k=50), P, rtol=1e-12)


def test_top_p_keeps_smallest_set_reaching_p():
    # cumulative best-first: 0.4, 0.65, 0.85, 0.95, 1.0
    np.testing.assert_allclose(probs_for(top_p=0.35), [0, 1, 0, 0, 0])
    np.testing.assert_allclose(probs_for(top_p=0.5), normalised([0, 0.4, 0, 0.25, 0]), rtol=1e-12)
    np.testing.assert_allclose(probs_for(top_p=0.8), normalised([0, 0.4, 0, 0.25, 0.2]), rtol=1e-12)
    np.testing.assert_allclose(probs_for(top_p=0.9), normalised([0, 0.4, 0.1, 0.25, 0.2]), rtol=1e-12)
    np.testing.assert_allclose(probs_for(top_p=0.01), [0, 1, 0, 0, 0])


def test_top_p_applies_after_top_k():
    # After top-k=3 the mass is 0.4/0.85, 0.25/0.85, 0.2/0.85; cumulative 0.47, 0.76, 1.0.
    np.testing.assert_allclose(probs_for(top_k=3, top_p=0.7), normalised([0, 0.4, 0, 0.25, 0]), rtol=1e-12)
    np.testing.assert_allclose(probs_for(top_k=3, top_p=0.8), normalised([0, 0.4, 0, 0.25, 0.2]), rtol=1e-12)


def test_min_p_is_relative_to_best():
    # threshold = min_p * 0.4
    np.testing.assert_allclose(probs_for(min_p=0.45), normalised([0, 0.4, 0, 0.25, 0.2]), rtol=1e-12)
    np.testing.assert_allclose(probs_for(min_p=0.7), normalised([0, 0.4, 0, 0, 0]))
    np.testing.assert_allclose(probs_for(min_p=0.1), P, rtol=1e-12)


def test_min_p_and_top_p_keep_the_intersection():
    np.testing.assert_allclose(probs_for(top_p=0.5, min_p=0.1), normalised([0, 0.4, 0, 0.25, 0]), rtol=1e-12)
    # top-p alone would keep 4 tokens; min-p cuts 0.1 too
    np.testing.assert_allclose(probs_for(top_p=0.9, min_p=0.3), normalised([0, 0.4, 0, 0.25, 0.2]), rtol=1e-12)


def test_temperature_applies_after_the_filters_like_llama_cpp():
    logits = np.log(np.array([0.5, 0.3, 0.2]))
    # top-p 0.7 on the plain softmax keeps tokens 0 and 1 (0.5 < 0.7 <= 0.8) whatever the
    # temperature; temperature then reshapes the two survivors.
    hot = target_probs(logits, SamplingParams(temperature=2.0, top_p=0.7))
    np.testing.assert_allclose(hot, normalised(np.sqrt([0.5, 0.3, 0])), rtol=1e-12)
    cold = target_probs(logits, SamplingParams(temperature=0.5, top_p=0.7))
    np.testing.assert_allclose(cold, normalised(np.square([0.5, 0.3, 0])), rtol=1e-12)


def test_ties_at_a_cut_are_kept_together():
    logits = np.array([3.0, 1.0, 2.0, 2.0, 0.0])
    kept = target_probs(logits, SamplingParams(temperature=1.0, top_k=2)) > 0
    assert kept.tolist() == [True, False, True, True, False]


def test_neg_inf_logits_get_no_mass():
    logits = np.array([-np.inf, 0.0, 1.0, -np.inf])
    probs = target_probs(logits, SamplingParams(temperature=0.7, top_p=0.99))
    assert probs[0] == probs[3] == 0
    assert math.isclose(probs.sum(), 1.0)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_k=40),
        SamplingParams(temperature=1.3, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=100, top_p=0.8, min_p=0.02),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=0.0),
    ],
)
def test_rows_of_a_matrix_match_single_rows(params):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((6, 3000)) * 3).astype(np.float32)
    logits[2, :] = 0.0  # a flat row
    matrix = target_probs(logits, params)
    assert matrix.dtype == np.float64 and matrix.shape == logits.shape
    for row, expected in zip(logits, matrix):
        np.testing.assert_allclose(target_probs(row, params), expected, rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(matrix.sum(axis=1), 1.0, rtol=1e-12)


def naive_top_p(logits, top_p):
    """Reference nucleus filter with a full sort."""
    probs = normalised(np.exp(logits - logits.max()))
    order = np.argsort(-probs, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]
    keep = np.zeros(len(probs), bool)
    keep[order[before < top_p]] = True
    return normalised(np.where(keep, probs, 0))


@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])
def test_top_p_on_a_large_vocabulary_matches_full_sort(scale):
    # scale 0.05 is nearly flat: the nucleus spans most of the vocabulary, past the first guess.
    logits = np.random.default_rng(1).standard_normal(262_144) * scale
    got = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.9))
    np.testing.assert_allclose(got, naive_top_p(logits, 0.9), rtol=1e-9, atol=1e-15)


def naive_filtered(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """Reference: full sort, filters one after another on the plain softmax, temperature last."""
    probs = normalised(np.exp(logits - logits.max()))
    order = np.argsort(-probs, kind="stable")
    if top_k:
        probs[order[top_k:]] = 0
        probs = normalised(probs)
    if top_p < 1:
        before = np.cumsum(probs[order]) - probs[order]
        probs[order[before >= top_p]] = 0
        probs = normalised(probs)
    probs[probs < min_p * probs.max()] = 0
    hot = np.exp((logits - logits.max()) / temperature) * (probs > 0)
    return normalised(hot)


@pytest.mark.parametrize("filters", [
    {"top_k": 40},
    {"top_k": 3000, "top_p": 0.5},
    {"top_p": 0.95, "min_p": 0.01},
    {"top_k": 100, "top_p": 0.8, "min_p": 0.05},
])
def test_filters_on_a_large_vocabulary_match_reference(filters):
    logits = (np.random.default_rng(7).standard_normal(262_144) * 4).astype(np.float32)
    got = target_probs(logits, SamplingParams(temperature=0.8, **filters))
    expected = naive_filtered(logits.astype(np.float64), 0.8, **filters)
    np.testing.assert_array_equal(got > 0, expected > 0)
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-15)


def test_greedy_probs_are_one_hot_on_first_maximum():
    probs = target_probs(np.array([[1.0, 5.0, 5.0], [7.0, 7.0, 0.0]]), SamplingParams())
    assert probs.tolist() == [[0, 1, 0], [1, 0, 0]]


def test_greedy_choose_token_takes_lowest_id_on_ties():
    rng = make_rng(0)
    assert choose_token(np.array([0.5, 2.0, 2.0, -1.0], np.float32), SamplingParams(), rng) == 1
    assert choose_token(np.zeros(10), SamplingParams(), rng) == 0


def test_draw_follows_probabilities_and_skips_zero_mass():
    rng = make_rng(3)
    probs = np.array([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    counts = np.bincount([draw(probs, rng) for _ in range(20_000)], minlength=6)
    assert counts[[0, 2, 5]].sum() == 0
    np.testing.assert_allclose(counts / counts.sum(), probs, atol=0.015)


def test_draw_over_many_blocks_follows_probabilities():
    # 1300 tokens: two full CDF blocks and a tail; mass in every part, some blocks empty
    probs = np.zeros(1300)
    probs[[3, 511, 512, 1023, 1200, 1299]] = [0.1, 0.2, 0.05, 0.15, 0.3, 0.2]
    rng = make_rng(8)
    counts = Counter(draw(probs, rng) for _ in range(20_000))
    assert set(counts) == {3, 511, 512, 1023, 1200, 1299}
    observed = [counts[t] for t in (3, 511, 512, 1023, 1200, 1299)]
    assert stats.chisquare(observed, np.array([0.1, 0.2, 0.05, 0.15, 0.3, 0.2]) * 20_000).pvalue > 1e-3


def test_draw_uses_exactly_one_uniform():
    rng_a, rng_b = make_rng(5), make_rng(5)
    draw(np.array([0.2, 0.8]), rng_a)
    rng_b.random()
    assert rng_a.random() == rng_b.random()


def test_seeded_sampling_is_reproducible():
    logits = np.random.default_rng(2).standard_normal(1000)
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=11)

    def run():
        rng = make_rng(params.seed)
        return [choose_token(logits, params, rng) for _ in range(50)]

    first = run()
    assert first == run()
    assert len(set(first)) > 5


def naive_log_softmax_topk(logits, k):
    logits = logits.astype(np.float64)
    logprobs = logits - logits.max(axis=1, keepdims=True)
    logprobs -= np.log(np.exp(logprobs).sum(axis=1, keepdims=True))
    ids = np.argsort(-logprobs, axis=1, kind="stable")[:, :k]
    return ids, np.take_along_axis(logprobs, ids, axis=1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_log_softmax_topk_matches_naive(dtype):
    logits = (np.random.default_rng(4).standard_normal((37, 5000)) * 4).astype(dtype)
    ids, logprobs = log_softmax_topk(logits, 8)
    ref_ids, ref_logprobs = naive_log_softmax_topk(logits, 8)
    assert ids.shape == logprobs.shape == (37, 8)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=1e-5 if dtype == np.float32 else 1e-10)
    assert (np.diff(logprobs, axis=1) <= 0).all()


def test_log_softmax_topk_blocks_rows(monkeypatch):
    import specrun.core.sampling as sampling

    monkeypatch.setattr(sampling, "_LSE_BLOCK_ELEMENTS", 3 * 500)  # 3 rows per block
    logits = np.random.default_rng(6).standard_normal((10, 500)).astype(np.float32)
    ids, logprobs = log_softmax_topk(logits, 4)
    ref_ids, ref_logprobs = naive_log_softmax_topk(logits, 4)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=1e-5)


def test_log_softmax_topk_finds_winners_sharing_a_group_and_in_the_tail():
    # 100 groups of 64 (token g, g + 100, ...) plus a 37-token tail: the 8 best tokens sit in
    # group 5 and in the tail, where a group-maximum shortcut could miss them.
    logits = np.random.default_rng(9).standard_normal((2, 6437)).astype(np.float32)
    winners = [5, 105, 205, 305, 6405, 6436, 6400, 6420]
    logits[:, winners] = 10 + np.arange(8, dtype=np.float32)
    ids, logprobs = log_softmax_topk(logits, 8)
    assert ids.tolist() == [winners[::-1]] * 2
    np.testing.assert_allclose(logprobs, naive_log_softmax_topk(logits, 8)[1], atol=1e-5)


def test_log_softmax_topk_orders_ties_by_id_and_clamps_k():
    ids, logprobs = log_softmax_topk(np.array([[1.0, 3.0, 3.0, 0.0]]), 10)
    assert ids.tolist() == [[1, 2, 0, 3]]
    np.testing.assert_allclose(np.exp(logprobs).sum(), 1.0)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top-k"),
        ({"top_k": 2.5}, "top-k"),
        ({"top_p": 0.0}, "top-p"),
        ({"top_p": 1.5}, "top-p"),
        ({"min_p": -0.1}, "min-p"),
        ({"min_p": 1.1}, "min-p"),
        ({"seed": -3}, "seed"),
    ],
)
def test_invalid_params_raise_usage_error(kwargs, word):
    with pytest.raises(UsageError, match=word):
        SamplingParams(**kwargs)


def test_greedy_property():
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.1).greedy
