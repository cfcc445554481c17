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


SAMPLED = SamplingParams(temperature=0.8)  # unseeded: reuses all of the cache it can


def test_prefix_reuse_prefills_only_new_tokens(target, plain):
    first = target.tokenize(PROMPTS[0])
    token_ids(plain, first, SAMPLED, 5)
    extended = first + target.tokenize(" And another line", add_special=False)
    token_ids(plain, extended, SAMPLED, 5)
    assert plain.stats.n_prefilled == len(extended) - len(first)
    # A conversation's next turn (the prompt runs on into the answer) reuses everything, greedy too.
    answer = token_ids(plain, first, SamplingParams(), 6)
    turn = first + answer[:5] + target.tokenize("\nMore.", add_special=False)
    token_ids(plain, turn, SamplingParams(), 2)
    assert plain.stats.n_prefilled == len(turn) - len(first) - 5


# About 700 tokens: a prefill of two batches (512 + the rest).
LONG_PROMPT = "<|im_start|>user\n" + " ".join(f"Item {i} is a {'red' if i % 3 else 'blue'} box." for i in range(110))


def _greedy(decoder, target, prompt) -> tuple[list[int], list[float]]:
    result = generate(decoder, target, prompt, SamplingParams(logprobs=1), 16)
    return result.tokens, [lp.logprob for lp in result.logprobs]


@pytest.mark.parametrize("text", [PROMPTS[0], LONG_PROMPT], ids=["short", "two batches"])
def test_a_greedy_prompt_is_evaluated_as_in_an_empty_cache(target, plain, text):
    """Issue 37, item 8: whatever the cache held before (another prompt sharing a beginning, the
    same prompt, a sampled answer), a greedy request gets the logits of a fresh prefill to the last
    bit, so the same answer even where its two best tokens are nearly tied."""
    prompt = target.tokenize(text)
    fresh_ctx = engine.Context(target, n_ctx=1024, n_batch=512)
    try:
        want = _greedy(PlainDecoder(target, fresh_ctx), target, prompt)
    finally:
        fresh_ctx.close()
    sharing = prompt[: len(prompt) * 5 // 6] + target.tokenize(" Something else entirely.", add_special=False)
    for before, params in ((sharing, SamplingParams()), (prompt, SAMPLED), (None, None)):
        if before is not None:
            token_ids(plain, before, params, 8)
        reused = plain.cache.reusable(prompt, exact=True)
        assert _greedy(plain, target, prompt) == want
        # What it cost: the tokens decoded again, fewer than a batch.
        assert plain.stats.n_prefilled == len(prompt) - reused and reused % 512 == 0 and len(prompt) - reused <= 512
