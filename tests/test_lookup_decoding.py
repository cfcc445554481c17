"""Lookup and hybrid trees give exactly the target's output: tests on the real offline models.

Same target and drafts as test_speculative.py (SmolLM2-135M F32; its Q4_1 file as the agreeing
draft), the same plain references and near-tie rule. Prompts come with and without text to copy.
"""

from __future__ import annotations

import logging
import time

import pytest
from conftest import TINY_THREADS
from test_speculative import (
    GREEDY,
    Contexts,
    binned,
    chat_prompt,
    check_divergences,
    compare,
    first_tokens,
    plain_reference,
)

from specrun.core.sampling import SamplingParams, make_rng
from specrun.core.tree_shapes import TreeShape
from specrun.decoding.drafters.best_first import TreeGrower
from specrun.decoding.drafters.hybrid import HybridDrafter
from specrun.decoding.drafters.lookup import LookupDrafter
from specrun.decoding.lookup_index import LookupIndex
from specrun.decoding.plain import PlainDecoder
from specrun.decoding.speculative import SpeculativeDecoder
from specrun.decoding.pay.guard import SpeedGuard
from specrun.decoding.stream import token_ids
from specrun.experiments.workloads import PASTED

N_CTX = 1024
TREE_BATCH = 320  # the largest tree below (draft 16 + lookup 256 nodes) + root

# Prompts whose answers copy (code edit, quote) and a free-form one with nothing to copy (few, for time).
COPY_PROMPTS = [
    f"Add type hints to this function and output the whole function:\n\n{PASTED['function']}",
    f"Quote the first sentence of this text verbatim:\n\n{PASTED['lighthouse']}",
]
FREE_PROMPTS = [
    "Write a haiku about autumn leaves.",
]
# Trimmed to keep the suite's time: the smallest useful tree and the default lookup budget.
LOOKUP_BUDGETS = (2, 64)
MATRIX_TOKENS = 24
LONG_TOKENS = 320
# Hybrid: a small draft tree plus lookup branches.
DRAFT_SHAPE = TreeShape(budget=4, depth=4, width=2, top_k=2)


def lookup_shape(budget: int, depth: int = 16) -> TreeShape:
    return TreeShape(budget=budget, depth=depth, width=1, top_k=1)


@pytest.fixture(scope="module")
def target(offline_models, load_model):
    return load_model(offline_models.smollm2_f32)


@pytest.fixture(scope="module")
def draft(offline_models, load_model):
    return load_model(offline_models.smollm2_q4)


@pytest.fixture(scope="module")
def contexts():
    owner = Contexts()
    yield owner
    owner.close()


@pytest.fixture(scope="module")
def plain(target, contexts) -> PlainDecoder:
    return PlainDecoder(target, contexts(target, n_ctx=N_CTX, n_batch=TREE_BATCH, n_seq_max=1))


@pytest.fixture(scope="module")
def references(plain):
    cache = {}

    def reference(prompt, n):
        key = tuple(prompt)
        if key not in cache or len(cache[key].tokens) < n and cache[key].tokens[-1] not in plain.eog:
            cache[key] = plain_reference(plain, prompt, n)
        return cache[key]

    return reference


@pytest.fixture(scope="module")
def prompts(target):
    return {
        "copy": [chat_prompt(target, text) for text in COPY_PROMPTS],
        "free": [chat_prompt(target, text) for text in FREE_PROMPTS],
    }


def lookup_decoder(target, contexts, budget, adapt=False, n_ctx=N_CTX, **index_options):
    shape = lookup_shape(budget)
    drafter = LookupDrafter(budget, index=LookupIndex(**index_options), adapt=adapt)
    return SpeculativeDecoder(target, contexts(target, n_ctx=n_ctx, n_batch=max(64, budget + 1)), drafter, shape)


def hybrid_decoder(target, draft, contexts, lookup_budget, adapt=False):
    shape = TreeShape(budget=DRAFT_SHAPE.budget + lookup_budget, depth=16, width=DRAFT_SHAPE.width, top_k=DRAFT_SHAPE.top_k)
    grower = TreeGrower(draft, contexts(draft, n_ctx=N_CTX, n_batch=64), DRAFT_SHAPE)
    drafter = HybridDrafter(grower, DRAFT_SHAPE.budget, lookup_budget, adapt=adapt)
    return SpeculativeDecoder(target, contexts(target, n_ctx=N_CTX, n_batch=TREE_BATCH), drafter, shape)


def lookup_share(stats) -> tuple[int, int]:
    """(tokens accepted from lookup nodes, from draft-model nodes) in a generation."""
    lookup = sum(s.lookup_tokens for s in stats.steps)
    return lookup, sum(s.accepted for s in stats.steps) - lookup


# ------------------------------------------------------------------------------------------------
# Greedy equality


@pytest.mark.parametrize("kind", ["lookup", "hybrid"])
def test_greedy_output_equals_plain_decoding(kind, target, draft, contexts, prompts, references):
    """Lookup-only and hybrid trees, several budgets, prompts with and without text to copy."""
    divergences, runs, from_lookup = [], 0, 0
    t0 = time.perf_counter()
    for budget in LOOKUP_BUDGETS:
        # A fresh drafter per budget: its session index then holds the prompts of this budget only.
        spec = lookup_decoder(target, contexts, budget) if kind == "lookup" else hybrid_decoder(target, draft, contexts, budget)
        for group, group_prompts in prompts.items():
            for index, prompt in enumerate(group_prompts):
                ref = references(prompt, MATRIX_TOKENS)
                out = token_ids(spec, prompt, GREEDY, MATRIX_TOKENS)
                runs += 1
                d = compare(ref, out, MATRIX_TOKENS, f"{kind}, budget {budget}, {group} prompt {index}")
                if d:
                    divergences.append(d)
                from_lookup += lookup_share(spec.stats)[0]
    print(f"\n{kind}: {runs} runs in {time.perf_counter() - t0:.1f} s, {from_lookup} tokens accepted from lookup")
    assert from_lookup > runs, "copy prompts should accept lookup tokens"
    check_divergences(divergences, runs, f"greedy {kind} matrix")


@pytest.mark.parametrize("kind", ["lookup", "hybrid"])
def test_greedy_long_generation_with_adaptation(kind, target, draft, contexts, prompts, references):
    """320+ tokens with the online adaptation on: matches span the prompt and generated text."""
    spec = lookup_decoder(target, contexts, 64, adapt=True) if kind == "lookup" else hybrid_decoder(target, draft, contexts, 32, adapt=True)
    # Raw text (no chat turn to end): the model writes on for all LONG_TOKENS tokens.
    prompt = target.tokenize(f"{PASTED['function']}\n\n{PASTED['function']}\n\ndef", add_special=True, parse_special=False)
    ref = references(prompt, LONG_TOKENS)
    out = token_ids(spec, prompt, GREEDY, LONG_TOKENS)
    assert len(out) >= 300, f"the generation ended after {len(out)} tokens"
    check_divergences([d for d in [compare(ref, out, LONG_TOKENS, f"long {kind}")] if d], 1, f"long {kind}")
    lookup, drafted = lookup_share(spec.stats)
    print(f"\nlong {kind}: {len(out)} tokens, {spec.stats.as_dict()}")
    # Lookup alone must find the pasted function; the hybrid's adaptation may leave a confident
    # draft model to do all of it (it weighs measured costs), but it must speculate.
    assert lookup > 0 if kind == "lookup" else lookup + drafted > len(out) // 2


# ------------------------------------------------------------------------------------------------
# Edge cases


def test_no_match_anywhere_decodes_like_plain(target, contexts, references):
    """A prompt of one token, then free text: steps without a proposal are plain steps."""
    spec = lookup_decoder(target, contexts, 16)
    prompt = target.tokenize("Once", add_special=False, parse_special=False)[:1]
    ref = references(prompt, 12)
    out = token_ids(spec, prompt, GREEDY, 12)
    check_divergences([d for d in [compare(ref, out, 12, "one-token prompt")] if d], 1, "one-token prompt")
    assert spec.stats.steps[0].tree_nodes == 0  # nothing to look up in one token


def test_runs_of_one_token(target, contexts, references):
    spec = lookup_decoder(target, contexts, 16)
    prompt = target.tokenize("a" + " a" * 200, add_special=True, parse_special=False)
    ref = references(prompt, 24)
    out = token_ids(spec, prompt, GREEDY, 24)
    check_divergences([d for d in [compare(ref, out, 24, "aaaa")] if d], 1, "aaaa")
    assert max(s.tree_nodes for s in spec.stats.steps) > 1


def test_a_greedy_step_on_this_cpu_passes_its_first_path_alone(target, contexts, references):
    """A greedy step with the cache to itself reads its tree's first path only (cells in order:
    accept_path's first_path), so its pass holds that path alone: the trees lookup proposes here
    branch (several lines of the prompt follow the same words), the passes are chains of their
    best paths, and the answer is plain decoding's."""
    spec = lookup_decoder(target, contexts, 32)
    proposed = []
    propose = spec.drafter.propose

    def recording(*args):
        proposal = propose(*args)
        if proposal is not None:
            proposed.append(len(proposal.tree.leaves()))
        return proposal

    spec.drafter.propose = recording
    lines = ["The red fox ran to the barn.", "The red fox ran to the river.", "The red fox ran to the hill."]
    prompt = target.tokenize(" ".join(lines * 3) + " The red fox", add_special=True, parse_special=False)
    ref = references(prompt, 24)
    assert token_ids(spec, prompt, GREEDY, 24) == ref.tokens
    drafted = [s for s in spec.stats.steps if s.tree_nodes]
    assert max(proposed) > 1 and drafted, proposed
    assert all(s.tree_leaves == 1 and s.tree_nodes == s.tree_depth for s in drafted)


def test_end_of_generation_inside_a_lookup_branch(target, contexts, references):
    """The answer to a question already answered once in the session is proposed whole, up to and
    including its end-of-generation token; generation ends inside the branch."""
    spec = lookup_decoder(target, contexts, 16)
    first = chat_prompt(target, "What is 17 + 25? Answer with the number only.")
    ref = references(first, 32)
    assert ref.tokens[-1] in target.eog_tokens and len(ref.tokens) < 32
    assert token_ids(spec, first, GREEDY, 32) == ref.tokens
    again = token_ids(spec, first, GREEDY, 32)  # the session's index has the whole answer now
    assert again == ref.tokens and spec.stats.finish_reason == "eog"
    assert spec.stats.steps[-1].lookup_tokens >= 1 and spec.stats.steps[-1].tokens[-1] in target.eog_tokens
    assert len(spec.stats.steps) < len(ref.tokens)


def test_more_continuations_than_the_leaf_limit(target, contexts, references):
    """Several hundred different continuations of the last token: the tree is cut to 256 leaves."""
    item = target.tokenize(" item", add_special=False, parse_special=False)[0]
    prompt = [t for i in range(300) for t in (item, 1000 + i)] + [item]  # 300 different tokens after " item"
    spec = lookup_decoder(target, contexts, 512, max_matches=1000)
    spec.cells_in_order = False  # as on a GPU: the whole tree verified (on this CPU, under 64 tokens)
    ref = references(prompt, 6)
    out = token_ids(spec, prompt, GREEDY, 6)
    check_divergences([d for d in [compare(ref, out, 6, "leaf limit")] if d], 1, "leaf limit")
    assert max(s.tree_leaves for s in spec.stats.steps) == 256


def test_context_nearly_full(target, contexts):
    """The tree shrinks to the room left; the output still equals plain decoding."""
    n_ctx = 256
    plain = PlainDecoder(target, contexts(target, n_ctx=n_ctx, n_batch=n_ctx, n_seq_max=1))
    spec = lookup_decoder(target, contexts, 64, n_ctx=n_ctx)
    text = "The old lighthouse stood on the cliff above the harbour. "
    prompt = target.tokenize(text * 30, add_special=True, parse_special=False)[:230]
    ref = plain_reference(plain, prompt, 100)
    out = token_ids(spec, prompt, GREEDY, 100)
    assert spec.stats.finish_reason == plain.stats.finish_reason == "context"
    check_divergences([d for d in [compare(ref, out, 100, "full context")] if d], 1, "full context")
    assert any(s.tree_nodes > 1 for s in spec.stats.steps)


# ------------------------------------------------------------------------------------------------
# Sampling is exact

SAMPLES = 1500


@pytest.fixture(scope="module")
def tiny(offline_models, load_model):
    return load_model(offline_models.smollm2_random)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lookup", "hybrid"])
def test_sampled_tokens_have_plain_distribution(kind, tiny, contexts, tiny_plain_samples):
    """Chi-square on the first 4 sampled tokens (the first from the prefill, then trees), with the tiny random model as target (and draft).

    The drafter lives through all runs: its session index holds every earlier sample, so its
    trees branch into the continuations sampled so far -- many branches, often accepted.
    """
    from scipy.stats import chi2_contingency

    params = SamplingParams(temperature=1.0)
    shape = lookup_shape(16, depth=3)
    if kind == "lookup":
        drafter = LookupDrafter(16, adapt=False)
    else:
        grower = TreeGrower(tiny, contexts(tiny, n_ctx=256, n_batch=64, threads=TINY_THREADS),
                            TreeShape(budget=2, depth=2, width=1, top_k=2))
        drafter = HybridDrafter(grower, 2, 14, adapt=False)
    spec = SpeculativeDecoder(tiny, contexts(tiny, n_ctx=256, n_batch=64, threads=TINY_THREADS), drafter, shape)
    prompt = chat_prompt(tiny, "Hi")
    spec_rng = make_rng(2)
    plain_samples = tiny_plain_samples(first_tokens, prompt, params, 1, SAMPLES)
    spec_samples, from_lookup, from_draft = [], 0, 0
    for _ in range(SAMPLES):
        spec_samples.append(first_tokens(spec, prompt, params, spec_rng))
        lookup, drafted = lookup_share(spec.stats)
        from_lookup, from_draft = from_lookup + lookup, from_draft + drafted
    table = binned(plain_samples, spec_samples)
    p_value = chi2_contingency(table).pvalue
    print(f"\n{kind}: {table.shape[1]} bins, {from_lookup / SAMPLES:.2f} lookup tokens accepted per run, p = {p_value:.3g}")
    # The tiny model drafting for itself leaves the hybrid's lookup branches little to add.
    assert from_lookup > (SAMPLES / 4 if kind == "lookup" else 0)
    assert from_lookup + from_draft > SAMPLES / 4
    assert table.shape[1] >= 10
    assert p_value >= 1e-3, f"{kind} sampling differs from plain sampling (p = {p_value:.2g})\n{table}"


# ------------------------------------------------------------------------------------------------
# The speed guard covers draft-model trees


def test_speed_guard_turns_a_losing_draft_tree_into_plain_steps_and_says_so_once(target, tiny, contexts, prompts, references, caplog):
    """A draft that is almost always wrong (the tiny random model) makes every tree lose: the guard
    (which soon measures plain steps itself, whatever the profile said) halves the tree down to
    plain steps, logs that once at info level, and the output stays the target's."""
    shape = TreeShape(budget=4, depth=4, width=1, top_k=1)
    grower = TreeGrower(tiny, contexts(tiny, n_ctx=N_CTX, n_batch=64), shape)
    # The margin asks trees to beat plain steps by half, not by 3%: a tree of 2 nodes that is
    # almost never accepted costs only a few percent more a token than a plain step on this CPU,
    # less than one plain step's seconds vary on a busy machine (it once judged it level in the
    # full suite). This way the guard's cuts do not hang on that noise.
    guard = SpeedGuard(shape.budget, plain_s=1e-6, window=4, margin=-0.5)
    spec = SpeculativeDecoder(target, contexts(target, n_ctx=N_CTX, n_batch=64), grower, shape, guard=guard)
    prompt = prompts["free"][0]
    ref = references(prompt, 64)
    with caplog.at_level(logging.DEBUG, logger="specrun"):
        out = token_ids(spec, prompt, GREEDY, 64)
    check_divergences([d for d in [compare(ref, out, 64, "guarded")] if d], 1, "guarded")
    assert guard.cap == 0 and spec.stats.steps[-1].tree_nodes == 0
    switches = [r for r in caplog.records if "switching to" in r.getMessage()]
    assert len(switches) >= 2 and [r.levelno for r in switches].count(logging.INFO) == 1


def test_without_a_profile_the_hybrid_times_both_models_at_load_and_leaves_their_caches_empty(target, draft, contexts, prompts, references):
    """A hybrid made without a profile times the draft's passes (catch-up, one-token expansions)
    and the target's (one token, the whole tree): the figures that say whether the draft's tree
    could pay at all. The probe leaves both caches empty: the answer is the target's own."""
    from specrun.runtime.drafters import BEST_FIRST
    from specrun.runtime.trees import TreePlan

    shape = TreeShape(budget=5, depth=5, width=1, top_k=1)
    target_ctx = contexts(target, n_ctx=N_CTX, n_batch=TREE_BATCH)
    draft_ctx = contexts(draft, n_ctx=N_CTX, n_batch=64)
    plan = TreePlan(shape, BEST_FIRST, "default", lookup=lookup_shape(64))
    drafter = plan.drafting.build(plan, draft, draft_ctx, target_ctx)
    best = drafter.best_case
    assert isinstance(drafter, HybridDrafter) and best is not None and drafter.catch_up_s > 0
    # Six tokens in one target pass cost more than one, and less than six one-token passes.
    assert best.plain_s < best.tree_s < 6 * best.plain_s
    assert best.step_s > 5 * best.catch_up_s > 0 and best.accepted == 5.0
    assert drafter.best_speedup() == pytest.approx(6 * best.plain_s / (best.tree_s + best.step_s))
    # Those target passes are the first points of the drafter's cost curve: a one-token pass as
    # timed, not a tree pass taken back at a prior cost per token.
    assert drafter.cost.plain_s() == pytest.approx(best.plain_s)
    assert float(drafter.cost([6])[0]) == pytest.approx(best.tree_s)
    decoder = SpeculativeDecoder(target, target_ctx, drafter, TreeShape(budget=69, depth=16, width=1, top_k=1))
    prompt = prompts["free"][0]
    out = token_ids(decoder, prompt, GREEDY, MATRIX_TOKENS)
    divergence = compare(references(prompt, MATRIX_TOKENS), out, MATRIX_TOKENS, "after the probe")
    check_divergences([divergence] if divergence else [], 1, "after the probe")


def test_an_answers_first_drafting_step_is_no_steady_step(target, draft, contexts, prompts):
    """A drafting step right after another catches up with the root and maybe the chain's last
    token: what the hybrid prices every drafting step with. A new answer's first drafting step
    catches up with its whole prompt instead; counted as a steady step (the last answer's last
    step had drafted), it priced the demo pair's drafting steps at 420 ms where they took 60,
    and `specrun bench` ran chat at 0.92x plain where the draft's chains alone ran 1.15x."""
    decoder = hybrid_decoder(target, draft, contexts, 64)  # not adapting: every step drafts
    drafter = decoder.drafter
    token_ids(decoder, prompts["free"][0], GREEDY, MATRIX_TOKENS)
    assert drafter.drafted and drafter.steady_debt.known  # the answer's last step drafted
    # Another text, sharing no beginning with the first: the draft catches up with all of it.
    second = target.tokenize("The three most important inventions of the twentieth century, and why each of them "
                             "changed how people live, are")
    assert len(second) > 16 and second[0] != prompts["free"][0][0]
    assert len(token_ids(decoder, second, GREEDY, MATRIX_TOKENS)) == MATRIX_TOKENS
    # Steady steps catch up with the root, and the chain's last token when it was accepted whole.
    assert drafter.steady_debt.mean <= 2.0
