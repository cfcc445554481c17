"""Plain decoding: the baseline every speedup is measured against."""

from __future__ import annotations

import pytest

from specrun import engine
from specrun.core.sampling import SamplingParams
from specrun.decoding.plain import PlainDecoder
from specrun.decoding.stream import generate, token_ids

PROMPTS = [
    "<|im_start|>user\nWrite a short poem about autumn leaves.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nExplain how a hash map works.<|im_end|>\n<|im_start|>assistant\n",
    "def quicksort(items):\n",
    "The three most important inventions of the twentieth century are",
]
N_TOKENS = 120


@pytest.fixture(scope="module")
def target(offline_models, load_model):
    return load_model(offline_models.smollm2_f32)


@pytest.fixture(scope="module")
def plain(target):
    ctx = engine.Context(target, n_ctx=1024, n_batch=512)
    yield PlainDecoder(target, ctx)
    ctx.close()


def _llama_greedy(path, prompt_tokens, n_tokens, eog):
    """Greedy tokens from llama-cpp-python's high-level Llama (the real peer, as oracle)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=1024, n_batch=512, n_threads=engine.default_threads(), verbose=False)
    try:
        out = []
        for token in llm.generate(prompt_tokens, temp=0.0, reset=True):
            out.append(int(token))
            if token in eog or len(out) >= n_tokens:
                break
        return out
    finally:
        llm.close()


def test_greedy_matches_llama_cpp_python(offline_models, target, plain):
    for prompt in PROMPTS:
        tokens = target.tokenize(prompt)
        ours = token_ids(plain, tokens, SamplingParams(), N_TOKENS)
        theirs = _llama_greedy(offline_models.smollm2_f32, tokens, N_TOKENS, target.eog_tokens)
        assert ours == theirs, f"diverged for prompt {prompt[:40]!r}"
        assert len(ours) >= 100 or ours[-1] in target.eog_tokens


def test_seeded_sampling_is_reproducible(target, plain):
    tokens = target.tokenize(PROMPTS[0])
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    first = token_ids(plain, tokens, params, 40)
    second = token_ids(plain, tokens, params, 40)
    other = token_ids(plain, tokens, SamplingParams(temperature=0.9, top_p=0.95, seed=99), 40)
    assert first == second
    assert first != other


def test_stop_strings_and_limits(target, plain):
    tokens = target.tokenize(PROMPTS[3])
    full = generate(plain, target, tokens, SamplingParams(), 60)
    assert full.stats.finish_reason in ("length", "eog")
    assert full.stats.n_generated <= 60
    word = full.text.split()[3]
    cut = generate(plain, target, tokens, SamplingParams(), 60, stop=[word])
    assert cut.stats.finish_reason == "stop"
    assert word not in cut.text
    assert full.text.startswith(cut.text)
    one = generate(plain, target, tokens, SamplingParams(), 1)
    assert one.stats.n_generated == 1 and len(one.tokens) == 1


def test_end_of_generation_stops(target, plain):
    tokens = target.tokenize("<|im_start|>user\nSay only the word yes.<|im_end|>\n<|im_start|>assistant\n")
    result = generate(plain, target, tokens, SamplingParams(), 200)
    assert result.stats.finish_reason == "eog"
    assert result.tokens[-1] in target.eog_tokens
    assert "<|im_end|>" not in result.text


def test_prefix_reuse_prefills_only_new_tokens(target, plain):
    first = target.tokenize(PROMPTS[0])
    token_ids(plain, first, SamplingParams(), 5)
    extended = first + target.tokenize(" And another line", add_special=False)
    token_ids(plain, extended, SamplingParams(), 5)
    assert plain.stats.n_prefilled == len(extended) - len(first)
