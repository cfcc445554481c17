"""Speculative decoding on the real demo models: same tokens as plain decoding, sane bookkeeping.

A compact, fast core check (the broad matrix lives in test_speculative.py). Greedy outputs must be
identical, except at a numerical near-tie: llama.cpp rounds differently for a 1-token pass and a
tree pass (see test_engine's drift report), so where plain decoding's two best logits are within
NEAR_TIE the two decoders may legitimately part ways.
"""

from __future__ import annotations

import numpy as np
import pytest

from specrun import engine, templates
from specrun.draft import TreeShape
from specrun.generate import PlainDecoder, token_ids
from specrun.sampling import SamplingParams
from specrun.speculative import SpeculativeDecoder

NEAR_TIE = 0.05
PROMPTS = [
    "Write a haiku about autumn leaves.",
    "Write a Python function that reverses a list.",
    "List three countries in Europe.",
    "¿Cuál es la capital de Francia?",
]
SHAPES = [
    TreeShape.chain(4),
    TreeShape(budget=4, depth=4, width=2, top_k=2),
    TreeShape(budget=16, depth=6, width=4, top_k=4),
    TreeShape(budget=64, depth=6, width=8, top_k=8),
]
N_TOKENS = 40


def _chat(model, text):
    rendered = templates.render_chat(model.chat_template, [{"role": "user", "content": text}])
    return model.tokenize(rendered)


@pytest.fixture(scope="module")
def target(offline_models, load_model):
    return load_model(offline_models.smollm2_f32)


@pytest.fixture(scope="module")
def contexts(target, offline_models, load_model):
    ctxs = {
        "target": engine.Context(target, n_ctx=1024, n_batch=512, n_seq_max=engine.MAX_SEQ),
        "agreeing": engine.Context(load_model(offline_models.smollm2_q4), n_ctx=1024, n_batch=512, n_seq_max=engine.MAX_SEQ),
        "random": engine.Context(load_model(offline_models.smollm2_random), n_ctx=1024, n_batch=512, n_seq_max=engine.MAX_SEQ),
    }
    yield ctxs
    for ctx in ctxs.values():
        ctx.close()


@pytest.fixture(scope="module")
def references(target, contexts):
    """Plain greedy tokens per prompt."""
    plain = PlainDecoder(target, contexts["target"])
    refs = {}
    for text in PROMPTS:
        prompt = _chat(target, text)
        refs[text] = (prompt, token_ids(plain, prompt, SamplingParams(), N_TOKENS))
    contexts["target"].clear()
    return refs


def _plain_gap(target, prompt, tokens) -> float:
    """Return plain decoding's logit gap between its two best tokens after prompt + tokens."""
    with engine.Context(target, n_ctx=1024, n_batch=512) as ctx:
        batch = engine.Batch(len(prompt) + len(tokens))
        batch.set_sequence(prompt + tokens, 0, 0, "last")
        ctx.decode(batch)
        top2 = np.sort(ctx.logits_row(-1))[-2:]
    return float(top2[1] - top2[0])


def _spec(target, contexts, draft, shape):
    contexts["target"].clear()
    contexts[draft].clear()
    return SpeculativeDecoder(target, contexts["target"], contexts[draft].model, contexts[draft], shape)


@pytest.mark.parametrize("draft", ["agreeing", "random"])
def test_greedy_speculative_equals_plain(target, contexts, references, draft):
    near_ties = 0
    for shape in SHAPES:
        spec = _spec(target, contexts, draft, shape)
        for prompt, expected in references.values():
            got = token_ids(spec, prompt, SamplingParams(), N_TOKENS)
            if got != expected:
                first = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
                gap = _plain_gap(target, prompt, expected[:first])
                assert gap < NEAR_TIE, f"{shape}: diverged at token {first} with a clear gap {gap:.3f}"
                near_ties += 1
            stats = spec.stats
            assert stats.n_generated == len(got) <= N_TOKENS
            assert all(s.total_s >= s.target_s >= 0 and s.draft_s >= 0 for s in stats.steps)
            if draft == "agreeing" and shape.budget > 1:
                assert stats.accepted_per_pass > 1.5, "the agreeing draft should be accepted often"
            # The target cache holds exactly the committed tokens; no tree colour survives.
            ctx = contexts["target"]
            assert ctx.seq_pos_max(0) == len(spec.cache.tokens) - 1
            assert all(ctx.seq_pos_max(c) == -1 for c in range(1, 8))
    assert near_ties <= 2, f"{near_ties} near-tie divergences"


def test_target_as_its_own_draft_accepts_full_depth(target, contexts, references, offline_models):
    twin_model = engine.Model(offline_models.smollm2_f32)
    with engine.Context(twin_model, n_ctx=1024, n_batch=512, n_seq_max=engine.MAX_SEQ) as twin:
        contexts["target"].clear()
        spec = SpeculativeDecoder(target, contexts["target"], twin_model, twin, TreeShape.chain(5))
        prompt, expected = references[PROMPTS[0]]
        got = token_ids(spec, prompt, SamplingParams(), 30)
        assert got == expected[:30]
        full = [s for s in spec.stats.steps if len(s.tokens) < 6 and s is not spec.stats.steps[-1]]
        assert not full, "a step accepted less than the full chain"
    twin_model.close()


def test_one_token_and_small_context(target, contexts, references, offline_models, load_model):
    prompt, expected = references[PROMPTS[1]]
    spec = _spec(target, contexts, "agreeing", TreeShape(budget=64, depth=8, width=8, top_k=8))
    assert token_ids(spec, prompt, SamplingParams(), 1) == expected[:1]
    # Budget far larger than the room left: trees shrink to fit, output still plain's.
    small_t = engine.Context(target, n_ctx=256, n_batch=512, n_seq_max=engine.MAX_SEQ)
    draft_model = load_model(offline_models.smollm2_q4)
    small_d = engine.Context(draft_model, n_ctx=256, n_batch=512, n_seq_max=engine.MAX_SEQ)
    try:
        spec = SpeculativeDecoder(target, small_t, draft_model, small_d, TreeShape(budget=128, depth=16, width=8, top_k=8))
        long_prompt = prompt * 5
        got = token_ids(spec, long_prompt, SamplingParams(), 400)
        assert spec.stats.finish_reason in ("context", "eog")
        assert len(long_prompt) + len(got) <= small_t.n_ctx + 1
    finally:
        small_t.close()
        small_d.close()


def test_seeded_sampling_matches_plain(target, contexts, references):
    """One uniform per emitted token: with the same seed, speculative sampling emits plain's tokens
    wherever the logits agree, so the first tokens coincide."""
    prompt, _ = references[PROMPTS[2]]
    params = SamplingParams(temperature=1.0, seed=7)
    plain = PlainDecoder(target, contexts["target"])
    contexts["target"].clear()
    expected = token_ids(plain, prompt, params, 4)
    spec = _spec(target, contexts, "agreeing", TreeShape.chain(3))
    assert token_ids(spec, prompt, params, 4)[:2] == expected[:2]
