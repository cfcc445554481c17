import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specrun.core.tree import MAX_LEAVES, DraftTree

PROPERTY_SETTINGS = settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def random_trees(draw, max_nodes=512):
    """A DraftTree of up to max_nodes nodes, shaped anywhere from a chain to a star."""
    n = draw(st.integers(1, max_nodes))
    seed = draw(st.integers(0, 2**32 - 1))
    # How far back a new node's parent may lie: 1 gives a chain, large values bushy trees.
    reach = draw(st.sampled_from([1, 2, 4, 32, 10_000]))
    rng = np.random.default_rng(seed)
    tree = DraftTree(root_token=int(rng.integers(100)), capacity=1)
    for i in range(1, n):
        parent = int(rng.integers(max(0, i - reach), i))
        # Some children are certain (log q = 0), so equal logps appear along paths.
        step = 0.0 if rng.random() < 0.2 else float(np.log(rng.random()))
        tree.add(parent, int(rng.integers(100)), tree.logps[parent] + step)
    return tree


def subtree_leaves(tree):
    """Per node, the set of leaf ids below it (naive reference)."""
    below = [set() for _ in range(len(tree))]
    for leaf in tree.leaves().tolist():
        for node in tree.path(leaf):
            below[node].add(leaf)
    return below


@PROPERTY_SETTINGS
@given(random_trees())
def test_tree_arrays_are_consistent(tree):
    n = len(tree)
    parents, depths = tree.parents, tree.depths
    assert parents[0] == -1 and depths[0] == 0 and tree.logps[0] == 0.0
    assert (parents[1:] < np.arange(1, n)).all()  # ancestors before descendants
    assert (depths[1:] == depths[parents[1:]] + 1).all()
    assert (tree.logps[1:] <= tree.logps[parents[1:]]).all()
    for i in range(n):
        assert all(parents[c] == i for c in tree.children(i))
        assert tree.is_leaf(i) == (i in set(tree.leaves().tolist()))
    assert sum(len(tree.children(i)) for i in range(n)) == n - 1
    assert tree.max_depth == depths.max()


@PROPERTY_SETTINGS
@given(random_trees())
def test_colours_follow_leaves(tree):
    leaves = tree.leaves()
    if len(leaves) > MAX_LEAVES:
        with pytest.raises(ValueError, match="leaves"):
            tree.colour_batch()
        return
    batch = tree.colour_batch()
    assert batch.n_colours == len(leaves)
    assert sorted(batch.leaf_nodes.tolist()) == leaves.tolist()
    np.testing.assert_array_equal(batch.tokens, tree.tokens)
    np.testing.assert_array_equal(batch.positions, tree.depths)
    colour_of = {int(leaf): c for c, leaf in enumerate(batch.leaf_nodes)}
    below = subtree_leaves(tree)
    seq_ids = batch.seq_ids
    assert seq_ids[0][0] == 0  # the root reads the committed prefix from seq 0
    colour_sets = [set(colours) for colours in seq_ids]
    for i in range(len(tree)):
        assert sorted(seq_ids[i]) == sorted(colour_of[leaf] for leaf in below[i])
        assert len(colour_sets[i]) == len(seq_ids[i])
        assert seq_ids[i][0] == batch.first_colour[i]
        assert all(seq_ids[i][0] in colour_sets[a] for a in tree.path(i))  # ancestors visible
    matrix = batch.seq_id_matrix(MAX_LEAVES)
    for i, colours in enumerate(seq_ids):
        assert matrix[i, : batch.colour_count[i]].tolist() == colours
    carriers = [[] for _ in range(batch.n_colours)]
    for node, colours in enumerate(seq_ids):
        for c in colours:
            carriers[c].append(node)
    for c, nodes in enumerate(carriers):
        assert nodes == tree.path(int(batch.leaf_nodes[c]))
        assert np.diff(tree.depths[nodes]).tolist() == [1] * (len(nodes) - 1)


@PROPERTY_SETTINGS
@given(random_trees(), st.integers(0, 600))
def test_prune_keeps_the_best_nodes_as_a_tree(tree, budget):
    old_tokens, old_logps, old_parents = tree.tokens.copy(), tree.logps.copy(), tree.parents.copy()
    old_paths = {i: tree.path(i) for i in range(len(tree))}
    old_children = [list(tree.children(i)) for i in range(len(tree))]
    ranking = sorted(range(1, len(tree)), key=lambda i: (-old_logps[i], i))
    expected = [0] + sorted(ranking[:budget])

    kept = tree.prune_to_best(budget)

    assert kept.tolist() == expected
    assert len(tree) == len(expected)
    np.testing.assert_array_equal(tree.tokens, old_tokens[kept])
    np.testing.assert_array_equal(tree.logps, old_logps[kept])
    new_id = {old: new for new, old in enumerate(kept.tolist())}
    for new, old in enumerate(kept.tolist()):
        if new:
            assert tree.parents[new] == new_id[int(old_parents[old])]
        assert [kept[j] for j in tree.path(new)] == old_paths[old]
        assert tree.depths[new] == len(old_paths[old]) - 1
        assert tree.children(new) == [new_id[c] for c in old_children[old] if c in new_id]


@PROPERTY_SETTINGS
@given(random_trees(max_nodes=200), st.integers(1, 40))
def test_with_leaves_keeps_the_best_subtree_within_the_leaves(tree, max_leaves):
    before = (tree.tokens.copy(), tree.parents.copy(), tree.logps.copy())
    sub, kept = tree.with_leaves(max_leaves)
    for array, old in zip((tree.tokens, tree.parents, tree.logps), before):
        np.testing.assert_array_equal(array, old)  # the proposal's own tree is left as it was
    leaves = len(tree.leaves())
    if leaves <= max_leaves:
        assert sub is tree and kept.tolist() == list(range(len(tree)))
        return
    assert len(sub.leaves()) <= max_leaves and sub.colour_batch(max_leaves).n_colours <= max_leaves
    assert kept[0] == 0 and kept.tolist() == sorted(set(kept.tolist()))
    np.testing.assert_array_equal(sub.tokens, tree.tokens[kept])
    np.testing.assert_array_equal(sub.logps, tree.logps[kept])
    for new in range(1, len(sub)):  # a node's parent here is its parent there
        assert kept[sub.parents[new]] == tree.parents[kept[new]]
    # the best node is in, and no node left out merely extends a kept leaf (it would cost no leaf)
    assert int(1 + np.argmax(tree.logps[1:])) in kept.tolist()
    kept_set = set(kept.tolist())
    kept_leaves = {int(kept[leaf]) for leaf in sub.leaves().tolist()}
    assert not [v for v in range(1, len(tree)) if v not in kept_set and int(tree.parents[v]) in kept_leaves]


def test_with_leaves_prefers_deeper_paths_to_more_leaves():
    tree = DraftTree(9)
    a = tree.add(0, 1, -0.1)
    tree.add(0, 2, -0.5)  # a second leaf: a branch of its own
    b = tree.add(a, 3, -0.2)
    tree.add(b, 4, -0.9)
    sub, kept = tree.with_leaves(1)
    assert kept.tolist() == [0, 1, 3, 4] and sub.tokens.tolist() == [9, 1, 3, 4]
    with pytest.raises(ValueError):
        tree.with_leaves(0)


def test_prune_breaks_ties_by_lower_id():
    tree = DraftTree(7)
    a = tree.add(0, 1, -1.0)
    tree.add(0, 2, -1.0)
    tree.add(0, 3, -2.0)
    tree.add(a, 4, -1.0)  # a certain child: the same logp as its parent
    assert tree.prune_to_best(3).tolist() == [0, 1, 2, 4]
    assert tree.tokens.tolist() == [7, 1, 2, 4]
    assert tree.parents.tolist() == [-1, 0, 0, 1]
    assert tree.prune_to_best(1).tolist() == [0, 1]  # the parent wins the tie with its child


def test_prune_refuses_rising_logp():
    tree = DraftTree(0)
    a = tree.add(0, 1, -5.0)
    tree.add(a, 2, -1.0)
    with pytest.raises(ValueError, match="logp"):
        tree.prune_to_best(1)


def test_leaf_cap():
    tree = DraftTree(0)
    tree.add_children(0, np.arange(MAX_LEAVES), np.full(MAX_LEAVES, -1.0))
    assert tree.colour_batch().n_colours == MAX_LEAVES
    tree.add(0, 999, -2.0)
    with pytest.raises(ValueError, match=f"{MAX_LEAVES + 1} leaves"):
        tree.colour_batch()
    assert tree.colour_batch(max_leaves=MAX_LEAVES + 1).n_colours == MAX_LEAVES + 1
    with pytest.raises(ValueError):
        DraftTree.chain(0, [1, 2, 3]).colour_batch(max_leaves=0)


def test_long_chain_has_one_colour_and_is_fast():
    tree = DraftTree.chain(5, np.arange(2047), -np.arange(1, 2048) * 0.1)
    start = time.perf_counter()
    batch = tree.colour_batch()
    elapsed = time.perf_counter() - start
    assert batch.n_colours == 1
    assert batch.seq_ids == [[0]] * 2048
    assert batch.positions.tolist() == list(range(2048))
    assert elapsed < 0.05


def test_wide_tree_layout_is_fast():
    # 256 leaves under 2048 nodes: 8 branches of 256 nodes, each ending in a fan of 32 leaves
    tree = DraftTree(0)
    for _ in range(8):
        node = 0
        for t in range(223):
            node = tree.add(node, t, -0.01 * (t + 1))
        tree.add_children(node, np.arange(32), np.full(32, -3.0))
    start = time.perf_counter()
    batch = tree.colour_batch()
    elapsed = time.perf_counter() - start
    assert batch.n_colours == MAX_LEAVES and len(tree) == 1 + 8 * 255
    assert batch.colour_count[0] == MAX_LEAVES
    assert elapsed < 0.05


def test_chain_constructor():
    tree = DraftTree.chain(9, [4, 5, 6], [-0.5, -1.0, -2.0])
    assert tree.tokens.tolist() == [9, 4, 5, 6]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.depths.tolist() == [0, 1, 2, 3]
    assert tree.path(3) == [0, 1, 2, 3]
    assert tree.leaves().tolist() == [3]
    assert tree.find_child(1, 5) == 2 and tree.find_child(1, 6) is None
    tree.add(3, 7, -3.0)  # a chain keeps growing like any tree
    assert tree.path(4) == [0, 1, 2, 3, 4]
    assert len(DraftTree.chain(1, [])) == 1


def test_add_children_and_expand():
    tree = DraftTree(0)
    ids = tree.add_children(0, np.array([10, 11]), np.array([-0.1, -2.0]))
    assert ids.tolist() == [1, 2]
    grid = tree.expand(ids, np.array([[20, 21, 22], [30, 31, 32]]), np.log(np.full((2, 3), 0.5)))
    assert grid.tolist() == [[3, 4, 5], [6, 7, 8]]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 1, 2, 2, 2]
    assert tree.depths[grid].tolist() == [[2] * 3] * 2
    np.testing.assert_allclose(tree.logps[grid[1]], -2.0 + np.log(0.5))
    assert tree.children(1) == [3, 4, 5]
    assert tree.find_child(2, 31) == 7
    assert tree.leaves().tolist() == [3, 4, 5, 6, 7, 8]
    assert not tree.is_leaf(0) and tree.is_leaf(8)
    with pytest.raises(IndexError):
        tree.add(9, 1, -1.0)
    with pytest.raises(IndexError):
        tree.expand([99], [[1]], [[-1.0]])


def test_growth_keeps_earlier_nodes():
    tree = DraftTree(3, capacity=1)
    for i in range(1, 1000):
        tree.add(i - 1, i, -float(i))
    assert len(tree) == 1000
    assert tree.tokens.tolist() == [3] + list(range(1, 1000))
    assert tree.parents.tolist() == [-1] + list(range(999))
    assert tree.max_depth == 999


@PROPERTY_SETTINGS
@given(random_trees(max_nodes=200), st.integers(0, 199))
def test_a_subtree_is_the_nodes_below_a_node_rooted_there(tree, node):
    node = node % len(tree)
    sub, old = tree.subtree(node)
    assert old[0] == node and len(sub) == len(old)
    for new, original in enumerate(old.tolist()):
        assert node in tree.path(original)  # every node kept lies below `node`
        assert sub.tokens[new] == tree.tokens[original]
        assert sub.depths[new] == tree.depths[original] - tree.depths[node]
        assert sub.logps[new] == pytest.approx(tree.logps[original] - tree.logps[node])
        if new:
            assert old[sub.parents[new]] == tree.parents[original]
    below = sum(1 for i in range(len(tree)) if node in tree.path(i))
    assert len(sub) == below


def test_prune_deeper_keeps_the_nodes_within_the_depth():
    tree = DraftTree.chain(7, [1, 2, 3, 4])
    tree.add(1, 9, -1.0)
    kept = tree.prune_deeper(2)
    assert kept.tolist() == [0, 1, 2, 5]
    assert tree.tokens.tolist() == [7, 1, 2, 9] and tree.max_depth == 2


def test_first_keeps_the_nodes_added_first_as_a_tree():
    tree = DraftTree.chain(7, [1, 2, 3])
    tree.add(0, 9, -1.0)
    cut, kept = tree.first(2)
    assert kept.tolist() == [0, 1, 2] and cut.tokens.tolist() == [7, 1, 2]
    assert cut.children(0) == [1] and cut.leaves().tolist() == [2]
    assert len(tree) == 5  # the tree itself is left as it is


def test_path_first_puts_the_first_child_path_at_the_head_of_the_batch():
    """The first-child path (colour 0) becomes nodes 0..d, so a batch lays its tokens in
    consecutive cells; the other nodes keep their order, every parent before its children, every
    child list its order, and `order` maps the new ids to the old."""
    tree = DraftTree(1)
    a = tree.add(0, 10, -0.1)   # 1: the root's first child
    b = tree.add(0, 20, -0.5)   # 2
    c = tree.add(b, 21, -0.6)   # 3
    d = tree.add(a, 11, -0.2)   # 4: a's first child
    e = tree.add(a, 12, -0.7)   # 5
    f = tree.add(d, 13, -0.3)   # 6: d's first child
    moved, order = tree.path_first()
    assert order.tolist() == [0, a, d, f, b, c, e]
    assert moved.tokens.tolist() == tree.tokens[order].tolist() == [1, 10, 11, 13, 20, 21, 12]
    assert moved.depths.tolist() == [0, 1, 2, 3, 1, 2, 2]
    assert all(moved.parents[i] < i for i in range(1, len(moved)))
    assert [moved.children(i) for i in range(len(moved))] == [[1, 4], [2, 6], [3], [], [5], [], []]
    assert moved.colour_batch().first_colour[:4].tolist() == [0, 0, 0, 0]
    assert np.allclose(moved.logps, tree.logps[order])
    chain = DraftTree.chain(1, [2, 3, 4])
    same, order = chain.path_first()
    assert same is chain and order.tolist() == [0, 1, 2, 3]
    # A grammar's forced run is the path laid first as far as the tree carries it (the target
    # takes it), then first children: b -> c here, c a leaf.
    forced, order = tree.path_first(along=[20, 21, 99])
    assert order.tolist() == [0, b, c, a, d, e, f] and forced.tokens[:3].tolist() == [1, 20, 21]
    partly, order = tree.path_first(along=[10, 12])
    assert order.tolist()[:3] == [0, a, e]


def test_path_first_follows_the_best_scored_children():
    """A branch added after a node's first child (lookup grafted beside a draft chain) and scored
    higher is the path laid first, the one a step that verifies one path checks; ties go to the
    first child."""
    tree = DraftTree(1)
    a = tree.add(0, 10, -0.4)   # 1: the draft's chain 10 -> 11
    d = tree.add(a, 11, -0.8)   # 2
    g = tree.add(0, 30, -0.1)   # 3: a grafted branch 30 -> 31 -> 32, likelier
    h = tree.add(g, 31, -0.2)   # 4
    i = tree.add(h, 32, -0.3)   # 5
    tie = tree.add(a, 12, -0.8)   # 6: as likely as d, added later
    moved, order = tree.path_first()
    assert order.tolist()[:4] == [0, g, h, i] and moved.tokens[:4].tolist() == [1, 30, 31, 32]
    assert moved.best_path() == [0, 1, 2, 3] and moved.colour_batch().first_colour[:4].tolist() == [0, 0, 0, 0]
    assert tree.path_first(along=[10])[1].tolist()[:3] == [0, a, d] and tie not in order[:3]
    alone, order = tree.path_first(alone=True)  # that path only: a chain, its scores kept
    assert order.tolist() == [0, g, h, i] and alone.tokens.tolist() == [1, 30, 31, 32]
    assert alone.parents.tolist()[1:] == [0, 1, 2] and np.allclose(alone.logps, tree.logps[order])
    chain = DraftTree.chain(1, [2, 3])
    assert chain.path_first(alone=True)[0] is chain
