"""The lookup drafter's n-gram index and trees, without a model."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specrun.core.tree import MAX_LEAVES, DraftTree
from specrun.decoding.lookup_index import LookupIndex, cut, graft, new_by_rank

PROPERTY_SETTINGS = settings(deadline=None, max_examples=80, suppress_health_check=[HealthCheck.too_slow])


def indexed(tokens, **options) -> LookupIndex:
    index = LookupIndex(**options)
    index.sync(tokens)
    return index


def paths(tree) -> set[tuple[int, ...]]:
    """Every root-to-node token path of a tree, root token excluded."""
    return {tuple(int(tree.tokens[n]) for n in tree.path(i)[1:]) for i in range(1, len(tree))}


def branches(tree) -> set[tuple[int, ...]]:
    """Root-to-leaf token paths, root token excluded."""
    return {tuple(int(tree.tokens[n]) for n in tree.path(i)[1:]) for i in tree.leaves().tolist()}


def check_tree_limits(tree, budget, depth, max_leaves=MAX_LEAVES):
    assert 1 <= len(tree) - 1 <= budget
    assert tree.max_depth <= depth
    assert len(tree.leaves()) <= max_leaves
    parents = tree.parents[1:]
    assert (tree.logps[1:] <= tree.logps[parents]).all()  # best-first pruning keeps a tree
    tree.colour_batch()  # fits one target pass


def followed(history, path) -> bool:
    """Whether `path` (root first) occurs in `history` with at least one token after the root."""
    history, path = list(history), list(path)
    return any(history[p : p + len(path)] == path for p in range(len(history) - len(path) + 1))


def test_repeated_text_proposes_what_followed():
    text = [5, 6, 7, 8, 9, 10, 11, 12, 40, 41, 5, 6, 7]
    tree = indexed(text).propose(text, budget=16, depth=5)
    assert tree.tokens[0] == 7
    assert branches(tree) == {(8, 9, 10, 11, 12)}


def test_different_continuations_branch_and_share_prefixes():
    # "1 2 3" was followed by "4 5 6", "4 5 7" and "9": a trie with 4 -> 5 shared.
    text = [1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 7, 0, 1, 2, 3, 9, 0, 1, 2, 3]
    tree = indexed(text).propose(text, budget=32, depth=3)
    assert branches(tree) == {(4, 5, 6), (4, 5, 7), (9, 0, 1)}
    assert len(tree) == 1 + 7  # 4, 5, 6, 7, 9, 0, 1: shared prefixes are one node
    [four] = [c for c in tree.children(0) if tree.tokens[c] == 4]
    [nine] = [c for c in tree.children(0) if tree.tokens[c] == 9]
    assert tree.logps[four] > tree.logps[nine]  # two of three occurrences went that way


def test_longer_matches_outweigh_the_last_token_alone():
    # The 4-gram "1 2 3 4" was followed by 50 once; "4" alone by 60 five times.
    text = [1, 2, 3, 4, 50] + [7, 4, 60] * 5 + [1, 2, 3, 4]
    tree = indexed(text).propose(text, budget=8, depth=1)
    best = max(tree.children(0), key=lambda c: tree.logps[c])
    assert tree.tokens[best] == 50
    assert {int(tree.tokens[c]) for c in tree.children(0)} == {50, 60}


def test_the_first_childrens_path_is_the_likeliest():
    """A lookup tree's children come best first, as a draft model's do, not in token order, and
    the path a greedy step on a CPU verifies (DraftTree.path_first) is the likeliest. Here the
    4-gram was followed by 50 then 51 once, "4" alone by 2 then 3 five times: the first children
    and the first path are the long match's, though its tokens are the larger."""
    text = [1, 2, 3, 4, 50, 51] + [7, 4, 2, 3] * 5 + [1, 2, 3, 4]
    tree = indexed(text).propose(text, budget=8, depth=2)
    assert [int(tree.tokens[tree.children(n)[0]]) for n in (0, 1)] == [50, 51]
    first, order = tree.path_first()
    assert [int(first.tokens[n]) for n in range(1, 3)] == [50, 51]
    assert first.best_path() == [0, 1, 2]


def test_no_match_proposes_nothing():
    text = list(range(100))
    index = indexed(text)
    assert index.propose(text, budget=16, depth=8) is None
    assert index.propose([1000, 1001], budget=16, depth=8) is None  # unseen tokens
    assert LookupIndex().propose([3], budget=16, depth=8) is None  # empty history
    assert index.propose(text[:50], budget=0, depth=8) is None
    assert index.propose(text[:50], budget=16, depth=0) is None


def test_match_with_nothing_after_it():
    # The only earlier "8 9" ends a stretch (the sequence was then replaced): nothing followed it.
    index = indexed([1, 8, 9])
    index.sync([2, 3, 8, 9])
    assert index.propose([2, 3, 8, 9], budget=8, depth=4) is None
    # The query's own occurrence at the end of the history is no match either.
    assert indexed([4, 8, 9]).propose([4, 8, 9], budget=8, depth=4) is None
    # A match right before the end reaches the end: a one-token continuation.
    text = [3, 8, 9, 8, 9]
    tree = indexed(text).propose(text, budget=8, depth=4)
    assert paths(tree) >= {(8,), (8, 9)}


def test_run_of_one_token_proposes_a_chain():
    text = [7] * 5000
    index = indexed(text)
    tree = index.propose(text, budget=32, depth=10)
    assert branches(tree) == {(7,) * 10}
    assert len(tree) == 11
    tree = index.propose(text, budget=4, depth=10)
    assert branches(tree) == {(7,) * 4}
    # A short run: what follows each earlier occurrence ends at the history's end.
    tree = indexed([7, 7, 7]).propose([7, 7, 7], budget=8, depth=8)
    assert branches(tree) == {(7, 7)}


def test_one_token_history():
    index = indexed([42])
    assert index.propose([42], budget=8, depth=8) is None
    index.extend([42])
    assert branches(index.propose([42, 42], budget=8, depth=8)) == {(42,)}


def test_more_continuations_than_leaves_are_cut():
    # 600 occurrences of token 1, each followed by its own two tokens: 600 branches on offer.
    rng = np.random.default_rng(0)
    text = []
    for i in range(600):
        text += [1, 1000 + i, int(rng.integers(5000, 5010))]
    text.append(1)
    index = indexed(text, max_matches=1000)
    for budget in (16, 300, 1000, 2048):
        tree = index.propose(text, budget=budget, depth=2)
        check_tree_limits(tree, budget, 2)
        assert len(tree.leaves()) <= MAX_LEAVES
    tree = index.propose(text, budget=2048, depth=2, max_leaves=10)
    assert len(tree.leaves()) == 10
    # The default reads at most 64 occurrences: at most 64 branches.
    assert len(indexed(text).propose(text, budget=2048, depth=2).leaves()) <= 64


def test_memory_stays_bounded_over_a_long_session(capsys):
    rng = np.random.default_rng(1)
    index = LookupIndex()
    for _ in range(100):  # a 10k-token session: prompts, then decoding steps of a few tokens
        index.extend(rng.integers(0, 32000, 60))
        for _ in range(10):
            index.extend(rng.integers(0, 32000, 4))
    assert len(index) == 10_000
    capacity = 16384  # the next power of two of 10k tokens
    assert index.nbytes() <= capacity * (5 + 8 * len(index.orders)) + 2 * index.live.nbytes
    with capsys.disabled():
        print(f"\nlookup index after a 10k-token session: {index.nbytes() / 1024:.0f} KiB")
    bounded = LookupIndex(max_tokens=4096)
    for _ in range(200):
        bounded.sync(rng.integers(0, 100, 300))  # new prompts: a new stretch each
        bounded.extend(rng.integers(0, 100, 50))
    assert len(bounded) <= 4096
    assert bounded.nbytes() <= 4096 * (5 + 8 * len(bounded.orders)) + 4 * 1024


def test_forgotten_text_is_not_proposed_and_recent_text_is():
    index = LookupIndex(max_tokens=256)
    index.extend([1, 2, 3, 99])
    index.extend(np.arange(1000, 2000) % 500 + 1000)
    index.extend([60, 61, 62, 63])
    index.extend([1, 2, 3])
    assert len(index) <= 256
    tree = index.propose([1, 2, 3], budget=8, depth=2)
    assert tree is None or (99,) not in paths(tree)
    index.extend([60, 61])
    assert (62, 63) in paths(index.propose(index.live, budget=8, depth=2))


def test_incremental_extend_matches_indexing_at_once():
    rng = np.random.default_rng(2)
    text = rng.integers(0, 20, 3000)
    whole = indexed(text)
    steps = LookupIndex()
    at = 0
    while at < len(text):
        size = int(rng.choice([1, 2, 5, 40, 300]))
        steps.extend(text[at : at + size])
        at += size
    for end in (10, 500, 2999, 3000):
        a = whole.propose(text[:end], budget=64, depth=8)
        b = steps.propose(text[:end], budget=64, depth=8)
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        np.testing.assert_array_equal(a.logps, b.logps)


def test_a_new_prompt_keeps_old_text_and_indexes_what_is_new():
    index = LookupIndex()
    first = [1, 2, 3, 4, 5, 6, 7, 8]
    assert index.sync(first) == 8
    assert index.sync(first + [9, 10]) == 2  # appended: only the tail is new
    # A new prompt sharing "1 2 3 4": the old continuation "5 6 7" is still there ...
    second = [1, 2, 3, 4, 20, 21, 22]
    assert index.sync(second) == 3
    assert index.live.tolist() == second
    tree = index.propose([1, 2, 3, 4], budget=16, depth=3)
    assert branches(tree) == {(5, 6, 7), (20, 21, 22)}  # ... and the new one, read across the join
    # A rewind (regenerating after the prompt) then a different continuation.
    index.sync([1, 2, 3, 4])
    index.extend([30])
    tree = index.propose([3, 4], budget=16, depth=1)
    assert {int(t) for t in tree.tokens[1:]} == {5, 20, 30}
    # Old stretches never continue into the next one.
    assert all(followed(first + [9, 10], (4,) + p) or followed(second, (4,) + p) or p == (30,) for p in paths(tree))


def test_sync_with_the_same_sequence_adds_nothing():
    index = indexed([1, 2, 3])
    before = len(index)
    assert index.sync([1, 2, 3]) == 0
    assert len(index) == before


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        LookupIndex().extend([1, -1])
    with pytest.raises(ValueError):
        LookupIndex(orders=(0,))
    with pytest.raises(ValueError):
        LookupIndex(max_matches=0)


@st.composite
def histories(draw):
    """Token sequences with repeats: a small vocabulary, sometimes copies of earlier stretches."""
    vocab = draw(st.sampled_from([2, 5, 50]))
    seed = draw(st.integers(0, 2**32 - 1))
    n = draw(st.integers(1, 400))
    rng = np.random.default_rng(seed)
    text = list(rng.integers(0, vocab, n))
    if n > 20 and rng.random() < 0.5:
        start = int(rng.integers(0, n - 10))
        text += text[start : start + int(rng.integers(5, 20))]
    return [int(t) for t in text]


@PROPERTY_SETTINGS
@given(histories(), st.integers(1, 300), st.integers(1, 12))
def test_every_proposed_path_followed_the_root_before(text, budget, depth):
    index = indexed(text, max_matches=10_000)
    tree = index.propose(text, budget, depth)
    # With every occurrence read, the first tokens are exactly those that ever followed the root.
    after_root = {text[p + 1] for p in range(len(text) - 1) if text[p] == text[-1]}
    if tree is None:
        assert not after_root
        return
    check_tree_limits(tree, budget, depth)
    assert all(followed(text, (text[-1],) + p) for p in paths(tree))
    for node in range(len(tree)):  # children best first (ties in token order)
        kids = tree.children(node)
        assert [(-float(tree.logps[c]), int(tree.tokens[c])) for c in kids] == sorted(
            (-float(tree.logps[c]), int(tree.tokens[c])) for c in kids)
    first = index.propose(text, budget=len(after_root), depth=1)
    assert {int(t) for t in first.tokens[1:]} == after_root


@PROPERTY_SETTINGS
@given(histories(), st.integers(1, 4))
def test_match_order_is_the_order_a_proposal_reports(text, at_least):
    index = indexed(text)
    for end in sorted({1, len(text) // 2 + 1, len(text)}):
        context = text[:end]
        index.propose(context, budget=8, depth=4)
        # The longest n-gram ending the context that occurs in the history with a token after it.
        longest = max((n for n in (1, 2, 3, 4) if n <= end and followed(text[:-1], context[-n:])), default=0)
        assert index.last_order == longest
        assert index.match_order(context, at_least) == (longest if longest >= at_least else 0)


@PROPERTY_SETTINGS
@given(histories(), st.lists(st.integers(1, 50), min_size=1, max_size=20), st.integers(1, 64), st.integers(1, 8))
def test_extending_in_pieces_equals_indexing_at_once(text, sizes, budget, depth):
    steps = LookupIndex()
    at, i = 0, 0
    while at < len(text):
        steps.extend(text[at : at + sizes[i % len(sizes)]])
        at += sizes[i % len(sizes)]
        i += 1
    whole = indexed(text)
    for end in {1, len(text) // 2 + 1, len(text)}:
        a = whole.propose(text[:end], budget, depth)
        b = steps.propose(text[:end], budget, depth)
        if a is None:
            assert b is None
        else:
            assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()


@PROPERTY_SETTINGS
@given(st.integers(0, 2**32 - 1), st.integers(1, 8), st.sampled_from([2, 3, 6]))
def test_a_session_of_prompts_proposes_only_what_followed_in_one_of_them(seed, n_prompts, vocab):
    rng = np.random.default_rng(seed)
    index, sequences, current = LookupIndex(max_matches=10_000), [], []
    for _ in range(n_prompts):
        # Each prompt keeps some prefix of the last one (possibly none), then goes its own way;
        # sometimes decoding steps extend it.
        keep = int(rng.integers(0, len(current) + 1))
        current = current[:keep] + [int(t) for t in rng.integers(0, vocab, int(rng.integers(0, 30)))]
        index.sync(current)
        for _ in range(int(rng.integers(0, 4))):
            step = [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 4)))]
            index.extend(step)
            current = current + step
        sequences.append(current)
    assert index.live.tolist() == current
    if not current:
        return
    root = current[-1]
    tree = index.propose(current, budget=64, depth=6)
    seen_after_root = {s[p + 1] for s in sequences for p in range(len(s) - 1) if s[p] == root}
    if tree is None:
        assert not seen_after_root
        return
    check_tree_limits(tree, 64, 6)
    assert all(any(followed(s, (root,) + p) for s in sequences) for p in paths(tree))
    first = index.propose(current, budget=len(seen_after_root), depth=1)
    assert {int(t) for t in first.tokens[1:]} == seen_after_root


def test_cut_keeps_the_best_nodes_and_leaves_the_tree_alone():
    text = [1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 7, 0, 1, 2, 3, 9, 0, 1, 2, 3]
    tree = indexed(text).propose(text, budget=32, depth=3)
    assert branches(cut(tree, 1)) == {(4,)}  # followed two of the three occurrences
    small = cut(tree, 3)
    assert len(small) == 4 and len(tree) == 8
    assert paths(small) < paths(tree)
    assert cut(tree, 100) is tree


def test_graft_adds_only_missing_nodes_within_the_leaf_limit():
    base = DraftTree.chain(1, [2, 3], [-0.1, -0.2])
    extra = DraftTree(1)
    two = extra.add(0, 2, -0.5)
    extra.add(two, 3, -0.6)
    nine = extra.add(two, 9, -0.7)
    extra.add(nine, 10, -0.8)
    extra.add(0, 5, -1.0)
    assert new_by_rank(base, extra).tolist() == [False, False, True, True, True]
    merged = DraftTree.chain(1, [2, 3], [-0.1, -0.2])
    placed = graft(merged, extra)
    assert placed.tolist() == [1, 2, 3, 4, 5]
    assert paths(merged) == {(2,), (2, 3), (2, 9), (2, 9, 10), (5,)}
    assert (merged.logps[1:] <= merged.logps[merged.parents[1:]]).all()
    limited = DraftTree.chain(1, [2, 3], [-0.1, -0.2])
    graft(limited, extra, max_leaves=2)
    assert len(limited.leaves()) == 2
