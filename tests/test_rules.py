"""Penalties, logit_bias and grammars under tree speculation, on toy models (pure numpy, fast).

A node's penalties and grammar state depend on the text along its own path: the acceptance walk
must shape each row it visits as plain decoding would after the same text. Same toy target and
draft trees as test_verify.py; the grammar is a small hand-written matcher.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from test_verify import VOCAB, assert_matches, scored_tree, toy_logits

from specrun.core.rules import PathRules
from specrun.core.sampling import SamplingParams, choose_token, make_rng, target_probs, token_logprobs
from specrun.core.verify import accept_path
from specrun.errors import UsageError


class NoRepeatThenForced:
    """A toy grammar over 5 tokens: a token never follows itself, and after token 4 come 1 then 2."""

    def __init__(self):
        self.last = None
        self.pending: list[int] = []

    def allowed(self) -> set[int]:
        if self.pending:
            return {self.pending[0]}
        return set(range(VOCAB)) - {self.last}

    def mask(self, row):
        for t in range(len(row)):
            if t not in self.allowed():
                row[t] = -np.inf

    def consume(self, token):
        assert token in self.allowed(), "the walk drew a token the grammar forbids"
        if self.pending:
            self.pending.pop(0)
        elif token == 4:
            self.pending = [1, 2]
        self.last = token

    def forced(self):
        return list(self.pending)


class ToyGrammar:
    def matcher(self):
        return NoRepeatThenForced()


PENALTIES = dict(presence_penalty=0.7, frequency_penalty=0.9, repeat_penalty=1.3, logit_bias=((2, 1.5), (0, -3.0)))
RULE_SETS = {
    "penalties": PENALTIES,
    "grammar": dict(grammar=ToyGrammar()),
    "both": dict(PENALTIES, grammar=ToyGrammar()),
}


def speculative(prompt, n_tokens, params, rng, draft_model):
    rules = PathRules.of(params)
    context, out = tuple(prompt), []
    while len(out) < n_tokens:
        tree, logits = scored_tree(context, draft_model)
        acc = accept_path(tree, logits, params, rng, max_tokens=n_tokens - len(out), rules=rules)
        out += acc.tokens
        context += acc.tokens
    return out


def plain(prompt, n_tokens, params, rng):
    rules = PathRules.of(params)
    context = tuple(prompt)
    for _ in range(n_tokens):
        token = choose_token(rules.shape(toy_logits(0, context)), params, rng)
        rules.accept(token)
        context += (token,)
    return list(context[len(prompt):])


@pytest.mark.parametrize("rules", list(RULE_SETS))
@pytest.mark.parametrize("draft_model", [0, 1])  # 0: the target drafts for itself
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_same_tokens_as_plain_decoding(rules, draft_model, temperature):
    params = SamplingParams(temperature=temperature, top_p=0.95, **RULE_SETS[rules])
    for seed in range(12):
        prompt = (seed % VOCAB, 3)
        assert speculative(prompt, 12, params, make_rng(seed), draft_model) == plain(prompt, 12, params, make_rng(seed))


@pytest.mark.parametrize("rules", ["penalties", "both"])
def test_sampled_tokens_follow_the_shaped_distribution(rules):
    """Chi-square against the exact distribution of 3 tokens, enumerated with plain rules."""
    params = SamplingParams(temperature=1.0, **RULE_SETS[rules])
    prompt, n_tokens, runs = (1, 2), 3, 4000
    expected = {}
    for seq in np.ndindex(*(VOCAB,) * n_tokens):
        prob, context, rules_ = 1.0, prompt, PathRules(params)
        for token in seq:
            prob *= target_probs(rules_.shape(toy_logits(0, context)), params)[token]
            if prob == 0:
                break
            rules_.accept(token)
            context += (token,)
        if prob > 0:
            expected[seq] = prob
    rng = make_rng(7)
    counts = Counter(tuple(speculative(prompt, n_tokens, params, rng, draft_model=1)) for _ in range(runs))
    assert set(counts) <= set(expected)
    assert_matches(counts, expected, runs)


def test_penalties_follow_each_path_not_just_committed_text():
    """Two sibling paths: the penalty at a node counts the node's own ancestors only."""
    params = SamplingParams(frequency_penalty=2.0)
    rules = PathRules(params)
    row = np.zeros(VOCAB, np.float32)
    rules.accept(3)
    rules.accept(3)
    shaped = rules.shape(row)
    assert shaped[3] == pytest.approx(-4.0) and shaped[[0, 1, 2, 4]].tolist() == [0, 0, 0, 0]
    assert row.tolist() == [0] * VOCAB, "shape() must not change the target's logits"


def test_repeat_penalty_is_llama_cpps():
    rules = PathRules(SamplingParams(repeat_penalty=2.0))
    for t in (0, 1):
        rules.accept(t)
    shaped = rules.shape(np.array([4.0, -4.0, 4.0, 0, 0], np.float32))
    assert shaped.tolist() == [2.0, -8.0, 4.0, 0, 0]


@pytest.mark.parametrize("penalty", [1e-300, 1e300])
def test_an_extreme_repeat_penalty_leaves_a_row_that_can_be_sampled(penalty):
    """Issue 37, item 4: 1e-300 divided a repeated token's logit to inf, and a sample needs a
    finite maximum (a 500 on the server); 1e300 multiplies one to -inf."""
    params = SamplingParams(temperature=1.0, repeat_penalty=penalty)
    rules = PathRules(params)
    for t in (0, 1, 3):
        rules.accept(t)
    shaped = rules.shape(np.array([4.0, -4.0, 1.0, 0.0, 0.5], np.float32))
    assert np.isfinite(shaped).all()
    probs = target_probs(shaped, params)
    assert probs.sum() == pytest.approx(1.0) and (probs[0] == 1.0 if penalty < 1 else probs[1] == 0.0)


def test_forced_tokens_come_from_the_grammar():
    rules = PathRules(SamplingParams(grammar=ToyGrammar()))
    assert rules.forced(5) == []
    rules.accept(4)
    assert rules.forced(5) == [1, 2] and rules.forced(1) == [1]


@pytest.mark.parametrize("bad", [
    dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repeat_penalty=0), dict(logit_bias=((1, 101.0),)),
    dict(logit_bias=((-1, 1.0),)), dict(logprobs=21), dict(logprobs=-1),
])
def test_bad_settings_are_refused(bad):
    with pytest.raises(UsageError):
        SamplingParams(**bad)


def test_logprobs_are_the_raw_log_softmax():
    rows = np.log(np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]], np.float32)) + 3.0
    out = token_logprobs(rows, [1, 2], 2)
    assert out[0].logprob == pytest.approx(np.log(0.3), abs=1e-6)
    assert out[1].logprob == pytest.approx(np.log(0.8), abs=1e-6)
    assert [t for t, _ in out[0].top] == [0, 1] and out[0].top[0][1] == pytest.approx(np.log(0.5), abs=1e-6)
    assert token_logprobs(rows, [0, 0], 0)[0].top == ()


def test_a_forced_run_is_grafted_where_the_drafters_tree_leaves_it():
    from specrun.core.tree import DraftTree
    from specrun.decoding.drafters.base import Proposal
    from specrun.decoding.speculative import graft_forced

    tree = DraftTree(9)
    a = tree.add(0, 1, -0.1)
    tree.add(a, 2, -0.2)
    tree.add(0, 3, -0.3)
    proposal = graft_forced(Proposal(tree), 9, [1, 4, 5], max_nodes=10)
    grafted = proposal.tree
    assert proposal.forced_from == 4 and grafted.path(len(grafted) - 1) == [0, a, 4, 5]
    assert [int(grafted.tokens[n]) for n in grafted.path(5)[1:]] == [1, 4, 5]
    assert len(tree) == 4  # the drafter's own tree is left as it proposed it
    assert proposal.forced_tokens([0, a, 4, 5]) == 2 and proposal.forced_tokens([0, a]) == 0
    # Already in the tree: nothing grafted. No drafter tree: the run is the tree.
    assert graft_forced(Proposal(DraftTree.chain(9, [1, 4])), 9, [1, 4], 10).forced_from is None
    alone = graft_forced(None, 9, [7, 8, 9], max_nodes=2)
    assert alone.tree.tokens.tolist() == [9, 7, 8] and alone.forced_from == 1
    # Chains stay chains: no graft at a branching point.
    assert graft_forced(Proposal(DraftTree.chain(9, [1, 2])), 9, [3], 10, chain=True).forced_from is None


def test_lookup_past_a_forced_run_is_grafted_at_the_runs_end():
    from specrun.core.tree import DraftTree
    from specrun.decoding.drafters.base import Proposal
    from specrun.decoding.speculative import graft_after_forced, graft_forced

    tree = DraftTree(9)
    tree.add(0, 1, -0.1)  # the drafter's (lookup's) node: the run's first token
    proposal = graft_forced(Proposal(tree, lookup_from=1), 9, [1, 4, 5], max_nodes=10)
    after = DraftTree(5)  # below the run's last token: a value and a branch
    v = after.add(0, 6, -0.05)
    after.add(v, 7, -0.5)
    after.add(0, 8, -2.0)
    mine = proposal.tree
    graft_after_forced(proposal, [1, 4, 5], after, max_nodes=10)
    out = proposal.tree
    assert proposal.forced_from == 2 and proposal.after_forced_from == 4 and len(mine) == 4  # (a copy)
    end = out.path(3)[-1]
    assert [int(out.tokens[n]) for n in out.path(len(out) - 1)[1:]] == [1, 4, 5, 8]
    six = out.find_child(end, 6)
    assert out.find_child(six, 7) is not None and float(out.logps[six]) <= float(out.logps[end])
    # Accepted: the run (2 forced: the first token was lookup's), then 2 past it (lookup's).
    accepted = [0, 1, 2, 3, six, out.find_child(six, 7)]
    assert proposal.forced_tokens(accepted) == 2 and proposal.lookup_tokens(accepted) == 3
    # Within max_nodes; a chain keeps one child a node; a run cut short takes nothing past it.
    few = graft_after_forced(graft_forced(Proposal(DraftTree(9)), 9, [1, 4, 5], 10), [1, 4, 5], after, max_nodes=4)
    assert len(few.tree) - 1 == 4
    chain = graft_after_forced(graft_forced(Proposal(DraftTree(9)), 9, [1, 4, 5], 10), [1, 4, 5], after, 10, chain=True)
    assert [int(t) for t in chain.tree.tokens] == [9, 1, 4, 5, 6, 7]
    cut = graft_forced(Proposal(DraftTree(9)), 9, [1, 4, 5], max_nodes=2)
    assert graft_after_forced(cut, [1, 4, 5], after, 10).after_forced_from is None
    # The drafter's lookup tree held the whole run: each accepted token counted once, as lookup's.
    held = Proposal(DraftTree.chain(9, [1, 4, 5]), lookup_from=1)
    graft_after_forced(held, [1, 4, 5], after, 10)
    path = held.tree.best_path()
    assert held.forced_from is None and held.lookup_tokens(path) == 5 and held.forced_tokens(path) == 0


def test_a_grafted_run_leaves_the_drafters_record_of_its_tree_whole():
    """Issue 37, item 1: lookup watched its tree (sizing its rank table by it), then the decoder
    grafted a grammar's forced run onto that same tree; walking the emitted run into the grafted
    nodes indexed past the table (IndexError, a 500 under a JSON schema)."""
    from specrun.core.tree import DraftTree
    from specrun.decoding.adaptive import Hindsight
    from specrun.decoding.drafters.base import Proposal
    from specrun.decoding.speculative import graft_forced

    tree = DraftTree.chain(9, [1, 2], [-0.1, -0.2])
    record = Hindsight(64)
    record.watch(tree)
    proposal = graft_forced(Proposal(tree), 9, [1, 2, 4, 5], max_nodes=10)
    assert [int(t) for t in proposal.tree.tokens] == [9, 1, 2, 4, 5]
    record.feed([1, 2, 4, 5, 6])  # what the target emitted: the forced run, then its own token
    assert record.accepted()[-1] == 2  # the walk matched the drafter's two nodes, not the grafted ones
