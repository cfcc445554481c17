"""The profiler on this machine: device probe, cost curves, acceptance calibration.

The calibration tests run the real demo pair (SmolLM2 F32 target, Q4_1 draft) greedy, with
width 1 so trees grow strictly best-first, and small trees so they stay fast.
"""

from __future__ import annotations

import time

import pytest

from specrun import engine
from specrun.core.sampling import SamplingParams
from specrun.core.tree_shapes import TreeShape
from specrun.decoding.drafters.base import Drafter
from specrun.decoding.drafters.best_first import TreeGrower
from specrun.decoding.plain import PlainDecoder
from specrun.decoding.speculative import SpeculativeDecoder
from specrun.decoding.stream import token_ids
from specrun.tuning import measure as profiler
from specrun.tuning.cost_model import accepted_depth

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [CHAT.format(text) for _, text in profiler.CALIBRATION_PROMPTS[:2]]
N_TOKENS = 40
THREADS = 1  # timings here are not asserted; one thread keeps a shared CPU from stalling


# --------------------------------------------------------------------------------------------
# Cost curves


@pytest.fixture(scope="module")
def pair(offline_models, load_model):
    target = load_model(offline_models.smollm2_f32)
    draft = load_model(offline_models.smollm2_q4)
    tctx = engine.Context(target, n_ctx=1024, n_batch=64, n_seq_max=engine.MAX_SEQ, threads=THREADS)
    dctx = engine.Context(draft, n_ctx=1024, n_batch=64, n_seq_max=engine.MAX_SEQ, threads=THREADS)
    yield target, tctx, draft, dctx
    dctx.close()
    tctx.close()


def test_cost_curve_measures_each_size_and_leaves_the_cache_empty(pair):
    target, tctx, _, _ = pair
    prompt = target.tokenize(PROMPTS[0])

    measured = profiler.measure_curve(tctx, prompt, [1, 4, 16], repeats=1, top_k=3)

    assert sorted(measured.decode) == [1, 4, 16]
    assert all(s > 0 for s in measured.decode.values())
    assert sorted(measured.topk) == [1, 4, 16]
    curve = measured.curve()
    assert curve.sizes == (1, 4, 16) and curve.t(16) >= measured.decode[16]
    assert tctx.seq_pos_max(0) == -1


def test_cost_curve_stops_at_the_deadline_after_the_first_size(pair):
    target, tctx, _, _ = pair
    prompt = target.tokenize(PROMPTS[0])

    measured = profiler.measure_curve(tctx, prompt, [1, 2, 4, 8], repeats=3, deadline=time.monotonic() - 1)

    assert list(measured.decode) == [1]


def test_cost_curve_never_decreases_with_more_tokens():
    # n = 1 was slowed by other work: it cannot cost more than a pass over 2 tokens
    measured = profiler.CurveMeasurement({1: 0.050, 2: 0.030, 4: 0.040, 8: 0.035}, {1: 0.001, 2: 0.001, 4: 0.001, 8: 0.001})

    curve = measured.curve()

    assert curve.seconds == pytest.approx((0.031, 0.031, 0.036, 0.036))


def test_curve_sizes_cover_the_largest_tree():
    assert profiler.curve_sizes(1) == [1]
    assert profiler.curve_sizes(65) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert profiler.curve_sizes(10**6)[-1] == profiler.MAX_CURVE_TOKENS


# --------------------------------------------------------------------------------------------
# Acceptance calibration


class _TopSubtreeCheck(Drafter):
    """A grower that, before growing the real tree, grows smaller trees from the same state and
    checks each is exactly the top-B' nodes (by best-first rank) of the big one."""

    def __init__(self, grower: TreeGrower, small_budgets):
        self.grower = grower
        self.small_budgets = small_budgets
        self.checked = 0
        self.mismatches = []

    def propose(self, committed, root, budget, depth):
        small = {}
        for b in self.small_budgets:
            grown = self.grower.propose(committed, root, b, depth)
            small[b] = _paths(grown.tree, range(1, len(grown.tree)))
            self.grower.commit(grown, [0])  # keep nothing: the draft is back where it was
        big = self.grower.propose(committed, root, budget, depth)
        ranks = big.best_first_ranks(range(len(big.tree)))
        for b, paths in small.items():
            top = _paths(big.tree, [n for n, r in zip(range(1, len(big.tree)), ranks) if r <= b])
            self.checked += 1
            if top != paths:
                self.mismatches.append((len(committed), b))
        return big

    def commit(self, grown, accepted_nodes):
        self.grower.commit(grown, accepted_nodes)


def _paths(tree, nodes) -> set[tuple[int, ...]]:
    return {tuple(int(tree.tokens[n]) for n in tree.path(i)[1:]) for i in nodes}


def test_smaller_best_first_tree_is_the_top_of_the_calibration_tree(pair):
    """The fact one-run calibration rests on, checked in the decoder's own states."""
    target, tctx, draft, dctx = pair
    shape = TreeShape(budget=16, depth=6, width=1, top_k=3)
    tctx.clear(), dctx.clear()
    checker = _TopSubtreeCheck(TreeGrower(draft, dctx, shape), small_budgets=(2, 5, 8))
    decoder = SpeculativeDecoder(target, tctx, checker, shape)

    token_ids(decoder, target.tokenize(PROMPTS[0]), SamplingParams(), 24)

    assert checker.checked >= 9
    assert checker.mismatches == []


def _accepted_per_pass(target, tctx, draft, dctx, shape, prompts) -> tuple[float, list[list[int]]]:
    tctx.clear(), dctx.clear()
    decoder = SpeculativeDecoder(target, tctx, TreeGrower(draft, dctx, shape), shape)
    tokens = passes = 0
    outputs = []
    for prompt in prompts:
        out = token_ids(decoder, prompt, SamplingParams(), N_TOKENS)
        outputs.append(out)
        # The first token comes from the prompt's prefill: tree steps make the rest.
        tokens += len(out) - 1
        passes += decoder.stats.n_passes - 1
    return tokens / passes, outputs


def test_tau_from_one_run_matches_separate_runs(pair):
    """tau(B) derived from a calibration run at budget 16 vs measured runs at budgets 2, 4, 8."""
    target, tctx, draft, dctx = pair
    prompts = [target.tokenize(p) for p in PROMPTS]
    depth, top_k = 6, 3
    cal = profiler.calibrate(target, tctx, draft, dctx, prompts, TreeShape(16, depth, 1, top_k), N_TOKENS)
    derived = cal.tau([2, 4, 8, 16])

    plain = PlainDecoder(target, tctx)
    tctx.clear()
    greedy = [token_ids(plain, p, SamplingParams(), N_TOKENS) for p in prompts]
    for budget in (2, 4, 8):
        measured, outputs = _accepted_per_pass(target, tctx, draft, dctx, TreeShape(budget, depth, 1, top_k), prompts)
        assert outputs == greedy
        # Separate runs split the text into different steps, so they agree on average, not per step.
        assert derived[budget] == pytest.approx(measured, rel=0.12), (budget, derived, measured)
    assert cal.n_tokens == sum(len(g) for g in greedy)
    assert derived[16] == pytest.approx((cal.n_tokens - len(prompts)) / len(cal.steps), rel=0.05)
    assert all(1.0 <= derived[a] <= derived[b] for a, b in [(2, 4), (4, 8), (8, 16)])


def test_calibration_records_steps_and_draft_ranks(pair):
    target, tctx, draft, dctx = pair
    prompt = target.tokenize(PROMPTS[1])
    cal = profiler.calibrate(target, tctx, draft, dctx, [prompt], TreeShape(8, 4, 2, 2), 24)

    assert cal.n_tokens == 24 and cal.steps
    assert cal.steps[0].first and not any(s.first for s in cal.steps[1:])
    assert all(s.tree_nodes <= 8 and s.expansions >= 1 and s.draft_passes >= 2 for s in cal.steps)
    # the draft reads the prompt in the first step, then only what it has not decoded yet
    assert cal.steps[0].catchup_tokens >= len(prompt)
    assert all(1 <= s.catchup_tokens <= 8 + 1 for s in cal.steps[1:])
    assert 1 <= cal.catchup_tokens() <= 9
    assert all(list(s.path_ranks) == sorted(s.path_ranks) for s in cal.steps)  # best-first ranks grow along a path
    assert len(cal.draft_ranks) == 24  # one rank per emitted token
    probs = cal.accept_probs()
    assert len(probs) == profiler.MAX_CHILD_RANK and sum(probs) <= 1.0
    assert probs[0] > 0.5  # an F32 target and its own Q4_1 quantization mostly agree
    assert cal.branching() > 0
    assert cal.overhead_s(None) >= 0.0
    assert profiler.Calibration.from_dict(cal.to_dict()).tau([1, 4, 8]) == cal.tau([1, 4, 8])


def test_target_as_its_own_draft_accepts_everything(pair):
    target, tctx, _, _ = pair
    own = engine.Context(target, n_ctx=1024, n_batch=64, n_seq_max=engine.MAX_SEQ, threads=THREADS)
    try:
        prompt = target.tokenize(PROMPTS[0])
        # 1 token from the prefill, then 3 steps of 4 accepted + 1, and a last plain one.
        cal = profiler.calibrate(target, tctx, target, own, [prompt], TreeShape(4, 4, 1, 2), 17)
    finally:
        own.close()

    assert cal.accept_probs()[0] == 1.0
    # Every step accepts its whole chain (depth <= 4) unless the token limit cut it short.
    assert all(accepted_depth(s.path_ranks, 4) == len(s.path_ranks) for s in cal.steps)
    assert cal.tau([4])[4] >= 4.0


def test_draft_ranks_of_the_drafts_own_greedy_text_are_all_one(pair):
    _, _, draft, dctx = pair
    prompt = draft.tokenize(PROMPTS[0])
    dctx.clear()
    out = token_ids(PlainDecoder(draft, dctx), prompt, SamplingParams(), 12)

    ranks = profiler.draft_ranks(dctx, prompt + out, len(prompt))

    assert ranks == [1] * len(out)
    assert dctx.seq_pos_max(0) == -1
