from collections import Counter
from functools import lru_cache

import numpy as np
import pytest
from scipy import stats

from specrun.core.sampling import (
    SamplingParams,
    choose_token,
    log_softmax_topk,
    make_rng,
    target_probs,
)
from specrun.core.tree import DraftTree
from specrun.core.verify import accept_path

GREEDY = SamplingParams()


def one_hot_logits(n_vocab, *best):
    """One logit row per entry of `best`, whose argmax is that token."""
    rows = np.zeros((len(best), n_vocab), np.float32)
    rows[np.arange(len(best)), best] = 5.0
    return rows


# --- greedy walks on hand-made logits -----------------------------------------------------


def example_tree():
    """root 10 -> {1: [3, 1], 2: [0]} ; node ids in brackets below."""
    tree = DraftTree(10)
    a = tree.add(0, 1, -0.5)  # [1]
    b = tree.add(0, 2, -1.0)  # [2]
    tree.add(a, 3, -1.0)  # [3]
    tree.add(a, 1, -2.0)  # [4]
    tree.add(b, 0, -2.0)  # [5]
    return tree


def test_greedy_walk_follows_the_target_and_adds_its_bonus():
    logits = one_hot_logits(8, 1, 1, 0, 0, 2, 0)  # rows per node: root->1, [1]->1, [4]->2
    acc = accept_path(example_tree(), logits, GREEDY, make_rng(0))
    assert acc.nodes == (0, 1, 4)
    assert acc.tokens == (1, 1, 2)
    assert acc.bonus == 2
    assert acc.accepted_depth == 2
    assert not acc.end_of_generation


class CountingRules:
    """Rules that shape nothing and count the tokens they hear (as a grammar's matcher follows them)."""

    def __init__(self):
        self.heard = []

    def shape(self, row):
        return row

    def accept(self, token):
        self.heard.append(token)


def test_a_first_path_walk_stops_where_the_target_leaves_that_path():
    # path_first lays the first-child path 0 -> [1] -> [3] as nodes 0, 1, 2. The target takes
    # token 1 at the root (on the path), then token 1 again: [4], off the path. Its token was
    # chosen by a first-path row and ends the step; no row off the path is read, and the rules
    # hear exactly the tokens emitted.
    tree, order = example_tree().path_first()
    assert list(order[:3]) == [0, 1, 3]
    rows = {0: 1, 1: 1}  # new id -> the target's choice; every other row would choose 0
    logits = one_hot_logits(8, *(rows.get(i, 0) for i in range(len(tree))))
    rules = CountingRules()
    walked = accept_path(tree, logits, GREEDY, make_rng(0), rules=rules, first_path=True)
    off = tree.find_child(1, 1)
    assert off != 2 and walked.left_to == off
    assert walked.nodes == (0, 1) and walked.tokens == (1, 1) and walked.bonus == 1 and rules.heard == [1, 1]
    whole = accept_path(tree, logits, GREEDY, make_rng(0))  # the walk goes on below [4] without it
    assert whole.nodes == (0, 1, off) and whole.tokens == (1, 1, 0) and whole.left_to is None
    # A walk that stays on the path is the same either way; an end token off it ends the answer.
    on = one_hot_logits(8, 1, 3, 5, 0, 0, 0)
    assert accept_path(tree, on, GREEDY, make_rng(0), first_path=True) == accept_path(tree, on, GREEDY, make_rng(0))
    ends = accept_path(tree, one_hot_logits(8, 2, 0, 0, 0, 0, 0), GREEDY, make_rng(0), eog_ids=frozenset({2}),
                       first_path=True)
    assert ends.nodes == (0,) and ends.tokens == (2,) and ends.bonus == 2 and ends.end_of_generation


def test_greedy_walk_rejecting_at_the_root_emits_one_token():
    acc = accept_path(example_tree(), one_hot_logits(8, 7, 0, 0, 0, 0, 0), GREEDY, make_rng(0))
    assert acc.nodes == (0,) and acc.tokens == (7,) and acc.bonus == 7 and acc.accepted_depth == 0


def test_greedy_ties_take_the_lowest_token():
    logits = np.zeros((6, 8), np.float32)
    logits[0, [2, 1]] = 3.0  # tie between 1 and 2: 1 wins, as in plain greedy decoding
    acc = accept_path(example_tree(), logits, GREEDY, make_rng(0))
    assert acc.nodes == (0, 1) and acc.tokens == (1, 0)


def test_only_visited_rows_are_read():
    logits = one_hot_logits(8, 2, 0, 0, 0, 0, 6)
    logits[[1, 3, 4]] = np.nan  # rows off the path must not matter
    for params in (GREEDY, SamplingParams(temperature=1e-3)):
        acc = accept_path(example_tree(), logits, params, make_rng(0))
        assert acc.nodes == (0, 2, 5) and acc.tokens == (2, 0, 6)


def test_end_of_generation_inside_the_tree_stops_there():
    tree = DraftTree.chain(0, [5, 9, 7])
    logits = one_hot_logits(16, 5, 9, 7, 3)
    acc = accept_path(tree, logits, GREEDY, make_rng(0), eog_ids=frozenset({9}))
    assert acc.nodes == (0, 1, 2) and acc.tokens == (5, 9)
    assert acc.bonus is None and acc.end_of_generation
    acc = accept_path(tree, logits, GREEDY, make_rng(0), eog_ids=lambda token: token == 5)
    assert acc.tokens == (5,) and acc.end_of_generation


def test_end_of_generation_as_the_bonus():
    tree = DraftTree.chain(0, [5, 6])
    acc = accept_path(tree, one_hot_logits(16, 2, 0, 0), GREEDY, make_rng(0), eog_ids=frozenset({2}))
    assert acc.tokens == (2,) and acc.bonus == 2 and acc.end_of_generation and acc.nodes == (0,)


@pytest.mark.parametrize("max_tokens, tokens, nodes", [
    (1, (5,), (0, 1)),
    (3, (5, 6, 7), (0, 1, 2, 3)),
    (4, (5, 6, 7, 8), (0, 1, 2, 3, 4)),
    (5, (5, 6, 7, 8, 1), (0, 1, 2, 3, 4)),
    (None, (5, 6, 7, 8, 1), (0, 1, 2, 3, 4)),
])
def test_max_tokens_is_never_exceeded(max_tokens, tokens, nodes):
    tree = DraftTree.chain(0, [5, 6, 7, 8])
    logits = one_hot_logits(16, 5, 6, 7, 8, 1)  # the target agrees all the way down
    acc = accept_path(tree, logits, GREEDY, make_rng(0), max_tokens=max_tokens)
    assert acc.tokens == tokens and acc.nodes == nodes
    assert acc.bonus == (1 if len(tokens) == 5 else None)


def test_bad_arguments():
    tree = example_tree()
    with pytest.raises(ValueError, match="row per tree node"):
        accept_path(tree, np.zeros((3, 8)), GREEDY, make_rng(0))
    with pytest.raises(ValueError, match="max_tokens"):
        accept_path(tree, np.zeros((6, 8)), GREEDY, make_rng(0), max_tokens=0)


# --- exactness of sampling: one step on hand-made distributions ---------------------------


def test_one_step_output_distribution_is_exactly_the_targets():
    # root -> {0: [2], 1}; nodes: [1] = "0", [2] = "1", [3] = "0 2". Vocabulary {0, 1, 2}.
    tree = DraftTree(0)
    first = tree.add(0, 0, -0.1)
    tree.add(0, 1, -0.2)
    tree.add(first, 2, -0.3)
    p = {  # the target's next-token distribution after each node
        0: [0.5, 0.3, 0.2],
        1: [0.1, 0.6, 0.3],
        2: [0.25, 0.35, 0.4],
        3: [0.1, 0.3, 0.6],
    }
    logits = np.log(np.array([p[i] for i in range(4)]))
    # Walking the tree, the emitted tokens are: a non-child token at the root; or "0" then the
    # target's token after "0" (descending once more on "2"); or "1" then its token after "1".
    expected = {(2,): p[0][2]}
    for t in range(3):
        expected[(1, t)] = p[0][1] * p[2][t]
        expected[(0, 2, t)] = p[0][0] * p[1][2] * p[3][t]
    for t in (0, 1):
        expected[(0, t)] = p[0][0] * p[1][t]
    assert np.isclose(sum(expected.values()), 1.0)

    rng = make_rng(1234)
    params = SamplingParams(temperature=1.0)
    runs = 12_000
    counts = Counter(accept_path(tree, logits, params, rng).tokens for _ in range(runs))
    assert set(counts) <= set(expected)
    assert_matches(counts, expected, runs)


def assert_matches(counts, expected, runs):
    """Chi-square goodness of fit; bins expected below 5 counts are pooled."""
    keys = sorted(expected, key=lambda key: -expected[key])
    exp = np.array([expected[key] for key in keys]) * runs
    obs = np.array([counts.get(key, 0) for key in keys], dtype=np.float64)
    small = exp < 5
    if small.any():
        exp = np.append(exp[~small], exp[small].sum())
        obs = np.append(obs[~small], obs[small].sum())
    assert obs.sum() == runs
    p_value = stats.chisquare(obs, exp * (runs / exp.sum())).pvalue
    assert p_value > 1e-3, f"emitted tokens do not follow the target (p = {p_value:.2g})"


# --- exactness over whole generations with a toy target and a toy draft ------------------

VOCAB = 5


@lru_cache(maxsize=None)
def toy_logits(model, prefix):
    """Next-token logits of a toy language model: a fixed random function of the prefix."""
    return np.random.default_rng([model, *prefix]).standard_normal(VOCAB) * 1.5


def draft_tree(context, draft_model, depth=2, width=2):
    """A full draft tree: each node's `width` likeliest draft tokens, down to `depth`."""
    tree = DraftTree(context[-1])
    frontier = np.array([0])
    for _ in range(depth):
        rows = np.stack([toy_logits(draft_model, continuation(tree, context, i)) for i in frontier])
        ids, logprobs = log_softmax_topk(rows, width)
        frontier = tree.expand(frontier, ids, logprobs).reshape(-1)
    return tree


def continuation(tree, context, node):
    return tuple(context) + tuple(int(tree.tokens[j]) for j in tree.path(node)[1:])


@lru_cache(maxsize=None)
def scored_tree(context, draft_model):
    tree = draft_tree(context, draft_model)
    logits = np.stack([toy_logits(0, continuation(tree, context, i)) for i in range(len(tree))])
    return tree, logits


def speculative(prompt, n_tokens, params, rng, draft_model):
    context, out = tuple(prompt), []
    while len(out) < n_tokens:
        tree, logits = scored_tree(context, draft_model)
        acc = accept_path(tree, logits, params, rng, max_tokens=n_tokens - len(out))
        out += acc.tokens
        context += acc.tokens
    return out


def plain(prompt, n_tokens, params, rng):
    context = tuple(prompt)
    for _ in range(n_tokens):
        context += (choose_token(toy_logits(0, context), params, rng),)
    return list(context[len(prompt):])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=3),
    SamplingParams(temperature=1.2, top_p=0.7, min_p=0.1),
])
def test_first_tokens_follow_the_target_distribution(params):
    prompt, n_tokens, runs = (1, 2), 3, 5000
    expected = {}
    for seq in np.ndindex(*(VOCAB,) * n_tokens):
        prob, context = 1.0, prompt
        for token in seq:
            prob *= target_probs(toy_logits(0, context), params)[token]
            context += (token,)
        if prob > 0:
            expected[seq] = prob
    rng = make_rng(99)
    counts = Counter(tuple(speculative(prompt, n_tokens, params, rng, draft_model=1)) for _ in range(runs))
    assert set(counts) <= set(expected)
    assert_matches(counts, expected, runs)


@pytest.mark.parametrize("draft_model", [0, 1])  # 0: the target drafts for itself
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.9, top_p=0.9, seed=5)])
def test_same_tokens_as_plain_decoding(params, draft_model):
    # Each emitted token uses one uniform, so even sampling matches plain decoding seed for seed.
    for seed in range(20):
        prompt = (seed % VOCAB, 3)
        assert speculative(prompt, 12, params, make_rng(seed), draft_model) == plain(
            prompt, 12, params, make_rng(seed)
        )


def test_target_as_its_own_draft_accepts_full_depth_when_greedy():
    context = (4, 0)
    for _ in range(10):
        tree, logits = scored_tree(context, 0)
        acc = accept_path(tree, logits, GREEDY, make_rng(0))
        assert acc.accepted_depth == tree.max_depth
        context += acc.tokens
