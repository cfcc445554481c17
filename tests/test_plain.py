"""Plain decoding: the baseline every speedup is measured against."""

from __future__ import annotations

import numpy as np
import pytest

from specrun import engine
from specrun.engine import compute
from specrun.core.sampling import SamplingParams
from specrun.core.tree_shapes import NETWORK_PASSES
from specrun.decoding.kv import RESUME_ALIGN, TILE_ROWS, CachedSequence, resumes_alike
from specrun.decoding.pay import counts
from specrun.decoding.plain import PlainDecoder
from specrun.decoding.stream import generate, stream, token_ids
from specrun.runtime.plan import WINDOW_LEAVES

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
    """Greedy tokens from llama-cpp-python's high-level Llama (the real peer, as oracle), decoded in
    the compute thread as every pass of specrun's is (engine.compute): a pass run from this
    thread would give libgomp a second team, and every later pass of the test run would be slower."""
    return compute.run(_llama_greedy_here, path, prompt_tokens, n_tokens, eog)


def _llama_greedy_here(path, prompt_tokens, n_tokens, eog):
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


def test_a_generations_figures_come_with_its_stream(target, plain):
    """Every chunk carries its generation's figures (complete on the last): a reader that stops
    early has those of what it read, and they stay its own when the decoder serves the next
    request (the server's decoders pass from request to request)."""
    tokens = target.tokenize(PROMPTS[3])
    chunks = stream(plain, target, tokens, SamplingParams(), 30)
    read = [next(chunks) for _ in range(5)]
    chunks.close()
    early = read[-1].stats
    assert all(chunk.stats is early for chunk in read) and early.n_generated == 5
    whole = list(stream(plain, target, tokens, SamplingParams(), 30))
    last = whole[-1].stats
    assert last is not early and last.n_generated == 30 and last.finish_reason == "length"
    assert early.n_generated == 5 and early.finish_reason is None


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
        assert plain.stats.n_prefilled == len(prompt) - reused
        # What it cost: the tokens decoded again, fewer than a batch; none where the cache still
        # holds this prompt as its last prefill wrote it (the prefill's last row was kept): the
        # same prompt again, sampled or greedy. Parting inside the second batch, after a tiled pass
        # held its tokens, it resumes there (on a multiple of RESUME_ALIGN), not at the batch's start.
        assert reused == len(prompt) or (reused % 512 % RESUME_ALIGN == 0 and len(prompt) - reused <= 512)
        assert (reused == len(prompt)) is (before is not sharing)
        if before is sharing and len(prompt) > 512 + TILE_ROWS:
            assert reused > 512


@pytest.mark.parametrize("alias", ["smollm2_f32", "gemma_q4"])
def test_a_prompt_parting_inside_a_batch_resumes_there_as_a_fresh_prefill(offline_models, load_model, alias):
    """Where the cached prompt's tokens came from a pass of TILE_ROWS tokens or more, a greedy
    prompt that parts from it inside that batch keeps them up to there (on a multiple of
    RESUME_ALIGN from the batch's start) and decodes the rest of the batch in one pass of
    TILE_ROWS or more: its last row and its cells are a fresh prefill's bit for bit (the F32 demo
    target, and Gemma 3's Q4_K_M, whose repacked products take tokens four at a time). Elsewhere
    (a cached chunk under TILE_ROWS, a resumed pass that would be under it) it goes back to the
    batch's start as before. The measurement (resumes_alike) leaves the cached text as it was."""
    model = load_model(getattr(offline_models, alias))
    text = model.tokenize(LIST_TEXT, add_special=False)
    other = model.tokenize(" Now the list ends and a story begins about a fox who", add_special=False) * 20

    def cells_and_row(ctx, cache, n):
        row = np.array(cache.logits)
        batch = engine.Batch(2, 1)
        batch.set_sequence(other[:2], n, cache.seq, "all")
        ctx.decode(batch)
        after = ctx.logits().copy()
        ctx.seq_rm(cache.seq, n, -1)
        return row, after

    def fresh(prompt):
        ctx = engine.Context(model, n_ctx=2048, n_batch=256)
        try:
            cache = CachedSequence(ctx, engine.Batch(256, 1))
            cache.sync(prompt, include_last=True, exact=True)
            return cells_and_row(ctx, cache, len(prompt))
        finally:
            ctx.close()

    ctx = engine.Context(model, n_ctx=2048, n_batch=256)
    try:
        probe = CachedSequence(ctx, engine.Batch(256, 1))
        probe.sync(text[:300], include_last=True)
        assert resumes_alike(ctx, probe.seq, 300, 2048)
        assert ctx.seq_pos_max(probe.seq) == 299  # left as it was
        cache = CachedSequence(ctx, engine.Batch(256, 1))
        # (cached prompt, shared tokens, new prompt, tokens it keeps): 256 + 100 cached from one pass.
        cases = [(356, 336, 406, 256 + 64), (356, 300, 500, 256 + 32), (356, 278, 428, 256),
                 (276, 270, 400, 256), (356, 300, 310, 256)]
        for cached, shared, n_new, kept in cases:
            cache.sync(text[:cached], include_last=True, exact=True)
            prompt = text[:shared] + other[: n_new - shared]
            _, prefilled, _ = cache.sync(prompt, include_last=True, exact=True)
            assert prefilled == n_new - kept, (cached, shared, n_new)
            got, want = cells_and_row(ctx, cache, n_new), fresh(prompt)
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), (cached, shared, n_new)
    finally:
        ctx.close()


@pytest.mark.parametrize("n_prompt", [40, 70])
def test_a_prompt_over_rpc_workers_is_filled_to_a_count_met_before_and_computes_the_same(target, monkeypatch, n_prompt):
    """Where the target runs on RPC workers a pass over a count of tokens not met before costs
    round trips (decoding.pay.counts): a prompt's pass is filled to a count met before, after the
    prompt in its sequence, asking no logits. Its last row and its cells are the prompt's alone,
    bit for bit (the F32 demo target); no filler stays in the cache; and a prompt under TILE_ROWS
    is never filled to TILE_ROWS or more (CPU attention takes such passes' rows in tiles)."""
    monkeypatch.setattr(counts, "_MET", {})
    prompt = (target.tokenize(PROMPTS[1] + PROMPTS[3] * 6, add_special=False))[:n_prompt]
    after = target.tokenize(" And then", add_special=False)[:2]

    def prefilled(network_s: float) -> tuple[np.ndarray, np.ndarray, int]:
        ctx = engine.Context(target, n_ctx=1024, n_batch=512)
        ctx.network_s = network_s
        try:
            cache = CachedSequence(ctx, engine.Batch(512, 1))
            cache.sync(prompt, include_last=True)
            row, last = np.array(cache.logits), ctx.seq_pos_max(cache.seq)
            batch = engine.Batch(2, 1)
            batch.set_sequence(after, n_prompt, cache.seq, "all")
            ctx.decode(batch)
            return row, ctx.logits().copy(), last
        finally:
            ctx.close()

    alone = prefilled(0.0)
    met = counts.met_counts(target)
    assert met.counts == {1}  # (nothing noted where the target runs here)
    beyond_tile = TILE_ROWS + 5 if n_prompt < TILE_ROWS else 0
    met.counts |= {n_prompt + 9, beyond_tile} - {0}
    filled = prefilled(0.05)
    assert n_prompt not in met.counts, met.counts  # the pass held the met count
    assert filled[2] == n_prompt - 1  # the filler's cells were given back
    assert np.array_equal(alone[0], filled[0]) and np.array_equal(alone[1], filled[1])
    # A count met but too far above (or across TILE_ROWS) is not taken: the pass meets a new count
    # anyway, and takes a tree pass's (NETWORK_PASSES) within FILL_GRID of its own.
    monkeypatch.setattr(counts, "_MET", {})
    met = counts.met_counts(target)
    met.counts |= {max(3 * n_prompt, beyond_tile)}
    far = prefilled(0.05)
    grid = min(n for n in NETWORK_PASSES if n >= n_prompt)
    assert grid in met.counts and n_prompt not in met.counts and grid <= counts.FILL_GRID * n_prompt, met.counts
    assert np.array_equal(alone[0], far[0]) and np.array_equal(alone[1], far[1])


# About 1,400 tokens of a list (Gemma's tokenizer): past the 1,024 cells Gemma 3 270M's window-sized
# cache keeps at a batch of 512 (its 512-token window and a batch).
LIST_TEXT = " ".join(f"Item {i} is a {'red' if i % 3 else 'blue'} box." for i in range(220))


def _fresh_logits(model, prompt) -> np.ndarray:
    """The last token's logits after a prefill into an empty cache that keeps every cell."""
    ctx = engine.Context(model, n_ctx=2048, n_batch=512)
    try:
        cache = CachedSequence(ctx, engine.Batch(512, 1))
        cache.sync(prompt, include_last=True)
        return np.array(cache.logits)
    finally:
        ctx.close()


def test_a_window_sized_cache_is_cut_back_only_where_it_still_holds_the_window(offline_models, load_model):
    """Issue 33: plain decoding keeps only the window of sliding-window layers, as llama.cpp does.
    Such a cache reuses the cells its window has passed, so a prompt that shares only an early
    part of the cached text cannot reuse it: the attention of its next tokens would miss what was
    overwritten (the logits of Gemma 3 270M then differed by 6.5, another token on top). It starts
    over; a prompt that parts from the text within the window reuses it."""
    model = load_model(offline_models.gemma_f32)
    ctx = engine.Context(model, n_ctx=2048, n_batch=512, swa_full=False)
    try:
        assert ctx.window == model.n_swa == 512
        cache = CachedSequence(ctx, engine.Batch(512, 1))
        text = model.tokenize(LIST_TEXT)[:1100]
        other = model.tokenize(" Now the list ends and a story begins.", add_special=False)
        for keep in (300, 800):
            cache.clear()
            cache.sync(text, include_last=True)
            oldest = ctx.seq_pos_min(cache.seq)
            assert oldest > 0  # the window's cells were reused: the text's start is gone
            prompt = text[:keep] + other
            _, prefilled, _ = cache.sync(prompt, include_last=True)
            got, want = np.array(cache.logits), _fresh_logits(model, prompt)
            if keep - model.n_swa < oldest:
                assert prefilled == len(prompt)  # started over: exactly a fresh prefill
                assert np.array_equal(got, want)
            else:
                assert prefilled == len(prompt) - keep  # the window before the cut is still held
                assert got.argmax() == want.argmax() and np.abs(got - want).max() < 1.0
    finally:
        ctx.close()


def test_plain_decoding_plans_and_opens_the_window_only(offline_models, cli):
    """The plan and the run agree: a plain run of a sliding-window model asks llama.cpp for window-
    sized caches (a fraction of the KV a tree run holds at the same context), and the greedy answer
    is the one a cache of every cell gives while the text fits the window's cells."""
    import json

    def planned(*args):
        out = cli("plan", "--json", "--target", "gemma3-270m-f32", "--ctx-size", "8192", "--gpu", "Test=80GiB", *args)
        assert out.exit_code == 0, out.output
        return json.loads(out.stdout)

    plain, trees = planned("--no-spec"), planned("--draft", "lookup")  # the target's contexts alone
    assert plain["contexts"]["target"]["swa_full"] is False and trees["contexts"]["target"]["swa_full"] is False
    kv = {name: plan["memory"]["breakdown"][0]["context"] for name, plan in (("plain", plain), ("trees", trees))}
    # Window layers of 1,024 cells against 8,192 for trees: llama.cpp gives a window-sized cache a
    # window per sequence, and trees open one per leaf, at most WINDOW_LEAVES (64-token lookup
    # trees are verified in their best part of 16 leaves) and the text's.
    assert kv["plain"] < kv["trees"] / 3, kv
    assert trees["tree"]["verified_budget"] == 64 > WINDOW_LEAVES, trees["tree"]
    assert trees["contexts"]["target"]["n_seq_max"] == WINDOW_LEAVES + 1 == 17, trees["contexts"]
    # Past 17 windows and a batch (9,216 cells) trees keep no more: at 64k the 15 window layers
    # hold 9,216 cells, not 65,536 (256 sequences' windows would have filled the context).
    wide = {name: planned(*args, "--ctx-size", "65536")["memory"]["breakdown"][0]["context"]
            for name, args in (("plain", ("--no-spec",)), ("trees", ("--draft", "lookup")))}
    full = 18 * 65536 / (3 * 65536 + 15 * 1024)  # every layer's cells, over plain's
    windows = (3 * 65536 + 15 * 9216) / (3 * 65536 + 15 * 1024)  # 17 windows and a batch, over plain's
    assert wide["trees"] / wide["plain"] < 1.05 * windows < 0.3 * full, (wide, windows, full)
    # The run opens what was planned (a load compares llama.cpp's allocation with the plan and
    # warns past 5%), and answers as a cache of every cell does on a text that fits the window.
    run = cli("generate", "--target", "gemma3-270m-f32", "--no-spec", "--ctx-size", "8192", "--max-tokens", "24",
              "--verbose", input="Name three colours.")
    assert run.exit_code == 0, run.output
    assert "memory: llama.cpp allocated" in run.stderr and "the memory plan is off" not in run.stderr
    # So do trees (their window-sized caches: tests/test_speculative.py), with the same answer.
    trees_run = cli("generate", "--target", "gemma3-270m-f32", "--draft", "lookup", "--ctx-size", "8192",
                    "--max-tokens", "24", "--verbose", input="Name three colours.")
    assert trees_run.exit_code == 0, trees_run.output
    assert "memory: llama.cpp allocated" in trees_run.stderr and "the memory plan is off" not in trees_run.stderr
    assert trees_run.stdout == run.stdout
