"""The memory of earlier answers (decoding.memory): one per loaded target, read by every request's
lookup beside its own text.

Unit tests on token lists (what it proposes, how far, its bound, threads), then the real offline
models (SmolLM2-135M F32 target; the Q4_1 file as the hybrid's draft): a request whose answer
repeats an earlier request's, drafted by another drafter that shares the memory, accepts more
tokens per target pass than in a fresh process, and its output is plain decoding's.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
from test_lookup_decoding import DRAFT_SHAPE, N_CTX, TREE_BATCH, lookup_shape
from test_speculative import GREEDY, Contexts, chat_prompt, plain_reference

from specrun.core.sampling import SamplingParams
from specrun.core.tree_shapes import TreeShape
from specrun.decoding.drafters.best_first import TreeGrower
from specrun.decoding.drafters.hybrid import HybridDrafter
from specrun.decoding.drafters.lookup import LookupDrafter
from specrun.decoding.lookup_index import LookupIndex
from specrun.decoding.memory import KEPT_PROMPT, LEAD, MEMORY_ORDERS, MIN_REACH, OLD_MAGIC, REACH_PER_TOKEN, OutputMemory
from specrun.decoding.plain import PlainDecoder
from specrun.decoding.speculative import SpeculativeDecoder
from specrun.decoding.stream import token_ids

ANSWER = list(range(1000, 1080))  # an earlier answer: 80 distinct tokens


def paths(tree) -> list[list[int]]:
    """Every root-to-leaf path of a tree's tokens, the root left out."""
    out = []
    for leaf in tree.leaves():
        path, node = [], int(leaf)
        while node != 0:
            path.append(int(tree.tokens[node]))
            node = int(tree.parents[node])
        out.append(path[::-1])
    return out


# ------------------------------------------------------------------------------------------------
# What it proposes


def test_a_long_match_drafts_far_and_a_weak_one_little():
    memory = OutputMemory()
    memory.remember([7, 8, 9] + ANSWER, 3)
    rows, weights, order, _ = memory.continuations([5, 5] + ANSWER[:20], 64)
    assert order == 20 and len(rows) == 1  # (the match's length: from LONG_MATCH a kind of its own)
    reach = int(REACH_PER_TOKEN * 20)  # 20 tokens matched: 40 tokens proposed
    assert rows[0].tolist() == ANSWER[20 : 20 + reach] + [-1] * (64 - reach)
    rows, weights_weak, _, _ = memory.continuations([5, 5] + ANSWER[18:20], 64)
    reach = max(MIN_REACH, int(REACH_PER_TOKEN * 2))
    assert rows[0].tolist() == ANSWER[20 : 20 + reach] + [-1] * (64 - reach)  # 2 matched: a few
    assert weights_weak[0] < weights[0] / 100


def test_the_answer_starts_from_the_end_of_its_prompt():
    """The prompt's last LEAD tokens come with the answer: a request whose prompt ends the same
    way (the chat template's assistant header) gets the answer from its first token on."""
    prompt = list(range(1, 40))
    memory = OutputMemory()
    memory.remember(prompt + ANSWER, len(prompt))
    rows, _, _, _ = memory.continuations([77, 78] + prompt[-LEAD:], 8)
    assert rows[0].tolist() == ANSWER[:8]
    assert len(memory) == 1 + len(prompt) + len(ANSWER)  # (a short prompt is kept whole)


def test_the_same_prompt_again_matches_all_the_prompt_kept():
    """KEPT_PROMPT prompt tokens come with each answer, only the last LEAD of them looked up: the
    same prompt again, in another lane, matches all of them from its first token (a repeat),
    while text that only resembles an earlier prompt's inside finds nothing there."""
    prompt = list(range(3000, 3100))
    memory = OutputMemory()
    memory.remember(prompt + ANSWER, len(prompt))
    assert len(memory) == 1 + KEPT_PROMPT + len(ANSWER)
    rows, _, order, match = memory.continuations(prompt, 8)
    assert match == KEPT_PROMPT and rows[0].tolist() == ANSWER[:8]
    assert order == LEAD  # (what weighs and reaches: the answer and the LEAD tokens before it)
    assert memory.continuations([1, 2] + prompt[-20:], 8)[3] == 20  # a shorter match is measured as it is
    assert len(memory.continuations(prompt[:-LEAD], 8)[0]) == 0  # the unindexed prompt is never looked up
    index = LookupIndex()
    index.sync(prompt)
    assert index.propose(prompt, 8, 8, memory=memory) is not None and index.last_match == KEPT_PROMPT


def test_more_often_and_more_recently_weigh_more():
    memory = OutputMemory()
    context = [1, 2, 3, 4, 5, 6]
    memory.remember(context + [10, 11], 0)  # older
    memory.remember(context + [20, 21], 0)
    memory.remember(context + [20, 21], 0)  # followed twice
    memory.remember(context + [30, 31], 0)  # newest
    index = LookupIndex()
    index.sync([99, 98, 1, 2, 3, 4, 5, 6])
    tree = index.propose(index.live, 16, 2, memory=memory)
    first = {int(tree.tokens[n]): float(tree.logps[n]) for n in range(1, len(tree)) if int(tree.parents[n]) == 0}
    assert first[20] > first[30] > first[10]
    rows, weights, _, _ = memory.continuations(index.live, 2)
    by_token = dict(zip(rows[:, 0].tolist(), weights.tolist()))
    assert by_token[30] > by_token[10]  # the same match, newer


def test_the_request_index_and_the_memory_propose_one_tree():
    memory = OutputMemory()
    memory.remember([1, 2, 3, 4, 5, 6, 7, 8] + [40, 41, 42, 43], 8)
    index = LookupIndex()
    index.sync([1, 2, 3, 4, 5, 6, 7, 8, 50, 51, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8])
    tree = index.propose(index.live, 32, 4, memory=memory)
    assert sorted(p[:2] for p in paths(tree)) == [[40, 41], [50, 51]]
    # Without the memory only the request's own text proposes.
    assert [p[:2] for p in paths(index.propose(index.live, 32, 4))] == [[50, 51]]
    # With nothing in the request's own text to match, the memory alone proposes.
    alone = LookupIndex()
    alone.sync([3, 4, 5, 6, 7, 8])
    assert paths(alone.propose(alone.live, 32, 4, memory=memory)) == [[40, 41, 42, 43]]
    assert alone.last_order == 6  # the 6 tokens it matched among the memory's answers


def test_the_memory_is_bounded_and_forgets_the_oldest():
    """Many answers later the memory holds its cap's bytes at most, and the newest answers."""
    cap = 1 << 14
    memory = OutputMemory(max_tokens=cap)
    rng = np.random.default_rng(0)
    for i in range(1000):  # each answer ends with a mark of its own, then the same three tokens
        memory.remember(rng.integers(0, 49152, 60).tolist() + [60_000 + i, 61_000 + i, 7, 7, 7], 0)
    capacity_bytes = cap * (5 + 8 * len(MEMORY_ORDERS)) + 4096
    assert len(memory) <= cap and memory.nbytes() <= capacity_bytes
    assert memory.answers == 1000
    assert memory.continuations([60_999, 61_999], 3)[0].tolist() == [[7, 7, 7]]
    assert len(memory.continuations([60_000, 61_000], 3)[0]) == 0  # the first answers are forgotten


def test_requests_in_threads_share_it_safely():
    """Lanes remember and propose at once (each request in a thread of its own)."""
    memory = OutputMemory(max_tokens=1 << 12)
    errors = []

    def lane(seed: int):
        rng = np.random.default_rng(seed)
        index = LookupIndex()
        try:
            for _ in range(150):
                text = rng.integers(0, 64, 40).tolist()
                index.sync(text)
                index.propose(index.live, 16, 8, memory=memory)
                memory.remember(text, 10)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=lane, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and memory.answers == 600 and len(memory) <= 1 << 12


# ------------------------------------------------------------------------------------------------
# Real models: a request repeats another's answer


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


def lookup_decoder(target, contexts, memory):
    """A lookup decoder of a fresh process's kind (the drafter adapts), reading `memory`."""
    drafter = LookupDrafter(64, memory=memory)
    return SpeculativeDecoder(target, contexts(target, n_ctx=N_CTX, n_batch=65), drafter, lookup_shape(64))


def hybrid_decoder(target, draft, contexts, memory):
    shape = TreeShape(budget=DRAFT_SHAPE.budget + 32, depth=16, width=DRAFT_SHAPE.width, top_k=DRAFT_SHAPE.top_k)
    grower = TreeGrower(draft, contexts(draft, n_ctx=N_CTX, n_batch=64), DRAFT_SHAPE)
    drafter = HybridDrafter(grower, DRAFT_SHAPE.budget, 32, memory=memory)
    return SpeculativeDecoder(target, contexts(target, n_ctx=N_CTX, n_batch=TREE_BATCH), drafter, shape)


ASKED = "Write four sentences about a cat who likes to sleep in the sun."
MAX_TOKENS = 64


def pass_s(n_tokens: int) -> float:
    """A target pass's seconds in these tests (conftest.VirtualClock): 20 ms, and 0.5 ms a token,
    about this CPU's one-token pass of the demo target and a slope at which a repeat's deepest
    tree pays. On measured times a pass met at a busy moment (a CI runner's) priced the deep
    tree out, and the regenerated answer went in 1-node trees."""
    return 0.020 + 0.0005 * n_tokens


@pytest.mark.parametrize("kind", ["lookup", "hybrid"])
def test_a_repeated_answer_is_drafted_from_another_requests_memory(kind, target, draft, contexts, plain, virtual_clock):
    """Request A answers; request B, another drafter that shares A's memory (another lane, as in
    the server), asks the same: its answer repeats A's and is drafted from the memory, more tokens
    a target pass than the same request in a fresh process (a memory of its own, empty). Every
    output is plain decoding's."""
    virtual_clock(pass_s)
    make = (lambda memory: lookup_decoder(target, contexts, memory)) if kind == "lookup" else (
        lambda memory: hybrid_decoder(target, draft, contexts, memory))
    prompt = chat_prompt(target, ASKED)
    reference = plain_reference(plain, prompt, MAX_TOKENS).tokens
    assert len(reference) >= 40, "the answer should be long enough to draft far"
    shared = OutputMemory()
    first = make(shared)
    assert token_ids(first, prompt, GREEDY, MAX_TOKENS) == reference
    assert shared.answers == 1
    fresh = make(OutputMemory())
    assert token_ids(fresh, prompt, GREEDY, MAX_TOKENS) == reference
    second = make(shared)
    assert token_ids(second, prompt, GREEDY, MAX_TOKENS) == reference
    with_memory, alone = second.stats.accepted_per_pass, fresh.stats.accepted_per_pass
    print(f"\n{kind}: {len(reference)} tokens; accepted per pass: fresh process {alone:.2f} "
          f"({fresh.stats.n_passes} passes), with the memory {with_memory:.2f} ({second.stats.n_passes} passes)")
    assert second.stats.total("lookup_tokens") > len(reference) / 2
    assert with_memory > 1.5 * alone and second.stats.n_passes < fresh.stats.n_passes / 2
    # The memory keeps the prompt before each answer: the same prompt in another drafter is a
    # repeat from its first step, verified as deep as the step may reach.
    assert second.stats.steps[1].accepted == second.shape.depth



@pytest.mark.parametrize("kind", ["lookup", "hybrid"])
def test_the_same_greedy_request_again_is_drafted_whole_from_its_first_step(kind, target, draft, contexts, plain,
                                                                            virtual_clock):
    """An answer regenerated (the same greedy request again, in the same lane): its text repeats
    the earlier one, so the first decoding step already verifies as deep a tree as the step may
    reach, accepted whole, where a kind that earns trust from nothing started at 3-5 nodes. The
    output is plain decoding's. Sampled, the same prompt is no repeat: its first step is not
    trusted so."""
    virtual_clock(pass_s)
    decoder = lookup_decoder(target, contexts, OutputMemory()) if kind == "lookup" else (
        hybrid_decoder(target, draft, contexts, OutputMemory()))
    prompt = chat_prompt(target, ASKED)
    reference = plain_reference(plain, prompt, MAX_TOKENS).tokens
    assert token_ids(decoder, prompt, GREEDY, MAX_TOKENS) == reference
    assert token_ids(decoder, prompt, GREEDY, MAX_TOKENS) == reference
    steps = decoder.stats.steps
    print(f"\n{kind}: regenerated in {len(steps)} passes, tokens a pass {[len(s.tokens) for s in steps]}")
    depth = decoder.shape.depth
    assert steps[1].tree_depth == depth and steps[1].accepted == depth
    assert len(steps) <= len(reference) // depth + 3
    if kind == "lookup":
        token_ids(decoder, prompt, SamplingParams(temperature=0.8), MAX_TOKENS, seed=None)
        assert decoder.stats.steps[1].tree_nodes < depth


@pytest.mark.parametrize("kind", ["lookup", "hybrid"])
def test_a_repeat_is_not_where_the_speed_guard_measures_plain_decoding(kind, target, draft, contexts, plain,
                                                                       virtual_clock):
    """With a speed guard (as every command's decoder has), the same greedy request again is
    drafted from its first step too: the guard's plain step, due after the first answer's
    speculative steps, waits while trees are accepted whole (and a plain first step counts, so
    the guard asks for one plain step, not two). The output is plain decoding's."""
    from specrun.decoding.pay.guard import SpeedGuard

    virtual_clock(pass_s)
    decoder = lookup_decoder(target, contexts, OutputMemory()) if kind == "lookup" else (
        hybrid_decoder(target, draft, contexts, OutputMemory()))
    decoder.sizer.guard = SpeedGuard(decoder.shape.budget)
    prompt = chat_prompt(target, ASKED)
    reference = plain_reference(plain, prompt, MAX_TOKENS).tokens
    assert token_ids(decoder, prompt, GREEDY, MAX_TOKENS) == reference
    for _ in range(2):
        assert token_ids(decoder, prompt, GREEDY, MAX_TOKENS) == reference
        steps = decoder.stats.steps
        print(f"\n{kind}: again, tokens a pass {[len(s.tokens) for s in steps]}")
        assert steps[1].tree_nodes > 0 and steps[1].accepted == steps[1].tree_depth
    assert decoder.sizer.guard._since_plain >= decoder.sizer.guard.window // 2  # (the probe was due)


def test_the_server_shares_the_memory_across_its_lanes(offline_models, tmp_path):
    """`serve --parallel 2`: request A answers beside a longer request B in the other lane; A asked
    again goes to A's lane with B's drafter (the last one used: runtime.pool), which never saw A's
    answer. It is drafted from the memory the lanes share, and is the same answer."""
    from test_server import TARGET, ServerProcess

    srv = ServerProcess(tmp_path / "home", "--draft", "lookup", "--parallel", "2")
    try:
        srv.wait_ready()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)

        def ask():
            return client.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": ASKED}],
                                                  max_tokens=MAX_TOKENS, temperature=0)

        with ThreadPoolExecutor(2) as pool:
            longer = pool.submit(client.completions.create, model=TARGET, prompt="Once upon a time, in a small village",
                                 max_tokens=3 * MAX_TOKENS, temperature=0)
            time.sleep(0.5)  # B holds a lane first: A takes the other
            first = pool.submit(ask).result()
            longer.result()
        again = ask()
    finally:
        assert srv.terminate() == 0, srv.stderr
    assert again.choices[0].message.content == first.choices[0].message.content
    before, after = (reply.model_extra["timings"] for reply in (first, again))
    print(f"\nserver: accepted per pass {before['accepted_per_pass']} beside B, {after['accepted_per_pass']} asked again "
          f"({after['lookup_n_accepted']} of {after['predicted_n']} tokens from lookup)")
    assert after["lookup_n_accepted"] > after["predicted_n"] / 2
    assert after["accepted_per_pass"] > 1.5 * before["accepted_per_pass"]


# ------------------------------------------------------------------------------------------------
# --memory: kept across runs


def test_a_saved_memory_comes_back_whole(tmp_path):
    memory = OutputMemory()
    memory.remember([1, 2, 3] + ANSWER, 3)
    memory.remember([4, 5] + ANSWER[:30], 2)
    path = tmp_path / "memory" / "m.bin"
    memory.save(path, "model A")
    back = OutputMemory()
    assert back.restore(path, "model A", 2000) is None
    assert back.answers == 2 and len(back) == len(memory)
    assert back.continuations(ANSWER[:10], 8)[0].tolist() == memory.continuations(ANSWER[:10], 8)[0].tolist()
    assert OutputMemory().restore(tmp_path / "none.bin", "model A", 2000) is None  # no file: nothing to say
    assert [p.name for p in path.parent.iterdir()] == ["m.bin"]  # written atomically: no temporary left
    prompt = list(range(1100, 1180))  # a prompt longer than what is looked up comes back as it was
    memory.remember(prompt + ANSWER, len(prompt))
    memory.save(path, "model A")
    back = OutputMemory()
    assert back.restore(path, "model A", 2000) is None
    assert back.continuations(prompt, 8)[3] == KEPT_PROMPT and len(back.continuations(prompt[:-LEAD], 8)[0]) == 0
    old = tmp_path / "old.bin"  # a file of the version before: every token indexed
    old.write_bytes(OLD_MAGIC + b'{"model": "model A", "tokens": 5, "answers": 1}\n'
                    + np.array([-1, 7, 8, 9, 10], "<i4").tobytes())
    back = OutputMemory()
    assert back.restore(old, "model A", 2000) is None and back.answers == 1 and len(back) == 5


@pytest.mark.parametrize("damage", ["foreign", "cut", "garbage", "other vocabulary"])
def test_a_corrupt_or_foreign_memory_is_set_aside_with_one_line(damage, tmp_path):
    path = tmp_path / "m.bin"
    memory = OutputMemory()
    memory.remember([1, 2, 3] + ANSWER, 3)
    memory.save(path, "model A")
    model, n_vocab = "model A", 2000
    if damage == "foreign":
        model = "model B"
    elif damage == "cut":
        path.write_bytes(path.read_bytes()[:-6])
    elif damage == "garbage":
        path.write_bytes(b"\x00\x01 not a memory")
    else:
        n_vocab = 1000
    fresh = OutputMemory()
    problem = fresh.restore(path, model, n_vocab)
    assert problem is not None and "\n" not in problem and str(path) in problem
    assert "fresh" in problem and len(fresh) == 0 and fresh.answers == 0


def test_each_model_and_key_has_a_memory_of_its_own(monkeypatch, tmp_path):
    from specrun.decoding.memory import memory_path

    monkeypatch.setenv("SPECRUN_MEMORY", str(tmp_path))
    files = {memory_path("a"), memory_path("b"), memory_path("a", "key 1"), memory_path("a", "key 2")}
    assert len(files) == 4 and all(f.parent == tmp_path for f in files)


def test_generate_with_memory_drafts_from_the_last_run(offline_models, monkeypatch, tmp_path, virtual_clock):
    """`generate --memory` twice: the second process drafts the answer the first wrote (more
    tokens a pass, the same text); without --memory nothing is saved or read. A damaged file is
    one warning line, and the run goes on with a fresh memory."""
    from typer.testing import CliRunner

    from specrun.cli import app

    monkeypatch.setenv("SPECRUN_MEMORY", str(tmp_path / "memory"))
    virtual_clock(pass_s)

    def run(*extra: str) -> tuple[dict, str]:
        result = CliRunner().invoke(app, ["generate", "--draft", "lookup", "--json", "-n", str(MAX_TOKENS), *extra, ASKED])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout), result.stderr

    plain_first, _ = run()
    assert not (tmp_path / "memory").exists()
    first, _ = run("--memory")
    (saved,) = (tmp_path / "memory").iterdir()
    (second, _), (without, _) = run("--memory"), run()
    assert plain_first["text"] == first["text"] == second["text"] == without["text"]
    print(f"\n--memory: accepted per pass {first['accepted_per_pass']} in the first run, "
          f"{second['accepted_per_pass']} in the second, {without['accepted_per_pass']} without --memory")
    assert second["accepted_per_pass"] > 1.5 * first["accepted_per_pass"]
    assert second["accepted_per_pass"] > 1.5 * without["accepted_per_pass"]
    saved.write_bytes(b"damaged")
    damaged, stderr = run("--memory")
    assert damaged["text"] == first["text"]
    warned = [line for line in stderr.splitlines() if "memory" in line]
    assert len(warned) == 1 and "ignoring the memory of answers" in warned[0] and "fresh" in warned[0], stderr
    listed = CliRunner().invoke(app, ["models"])
    assert listed.exit_code == 0 and "1 answer(s), " in listed.stderr and str(saved) in listed.stderr, listed.stderr


def test_a_busy_moment_at_the_first_tree_pass_does_not_stop_the_memorys_drafts(offline_models, monkeypatch, tmp_path, virtual_clock):
    """The first lookup tree of a run met a busy machine (its pass timed 20x what it cost): the
    remembered answer is still drafted. One such pass once priced every tree out for the whole
    answer (1.03 tokens a pass, where a quiet run took 7.5), since trees not tried are never
    timed again."""
    from typer.testing import CliRunner

    from specrun.cli import app
    from specrun.decoding.adaptive import TargetCost

    monkeypatch.setenv("SPECRUN_MEMORY", str(tmp_path / "memory"))
    virtual_clock(pass_s)  # (the busy pass is the one below, not a moment of the runner's)
    observe, busy = TargetCost.observe, []

    def first_tree_pass_busy(self, n_tokens: int, seconds: float) -> None:
        if n_tokens > 1 and self not in busy:
            busy.append(self)
            seconds *= 20
        observe(self, n_tokens, seconds)

    def run() -> dict:
        result = CliRunner().invoke(app, ["generate", "--draft", "lookup", "--json", "-n", str(MAX_TOKENS), "--memory", ASKED])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    first = run()
    monkeypatch.setattr(TargetCost, "observe", first_tree_pass_busy)
    second = run()
    assert busy and second["text"] == first["text"]
    assert second["accepted_per_pass"] > 3, second["accepted_per_pass"]
