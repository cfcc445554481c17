"""Several requests at once (--parallel): their target passes shared, each answer its own.

A real `specrun serve --parallel 4` on the demo pair (speculative, Qwen 2.5's real template so that
tools work), driven by the official openai client from several threads; every greedy answer is
compared with the same request sent alone. Then the engine without a server: a hybrid target
(random qwen35, chains with rollbacks) decoding two requests in lanes of one context, and the
memory plan for N requests against what llama.cpp allocates.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from conftest import MODEL_CACHE, ROUND_TRIP_S, passes_a_round_trip_away
from pinned_sources import template
from test_server import API_KEY, TARGET, ServerProcess
from test_server_structured import ADD, PERSON, WEATHER
from test_speculative import binned, first_tokens
from tiny_archs import tiny_arch_model

from specrun import engine
from specrun.engine import Batch
from specrun.core.sampling import SamplingParams, make_rng
from specrun.core.tree_shapes import TreeShape
from specrun.decoding.batching import Lane, PassGate, _Handed
from specrun.core.tree import DraftTree
from specrun.decoding.drafters.base import Drafter, Proposal
from specrun.decoding.drafters.best_first import TreeGrower
from specrun.decoding.drafters.lookup import LookupDrafter
from specrun.decoding.pay import counts
from specrun.decoding.pay.rules import ALONE, Beside
from specrun.decoding.pay.together import Together
from specrun.decoding.plain import PlainDecoder
from specrun.decoding.speculative import SpeculativeDecoder
from specrun.limits import MAX_SEQ
from specrun.runtime.plan import RunOptions
from specrun.runtime.runtime import Runtime

PARALLEL = 4
QUESTIONS = ["Name three colours.", "Write a haiku about the sea.", "What is the capital of France?",
             "Count from 1 to 10."]
LONG_ANSWERS = ["Once upon a time, in a small village by the sea,", "The history of the Roman Empire",
                "Here is a list of fruits: apple, banana,"]


@pytest.fixture(scope="module")
def server(offline_models, tmp_path_factory):
    home = tmp_path_factory.mktemp("serve-parallel")
    path = home / "qwen.jinja"
    path.write_text(template("Qwen-Qwen2.5-7B-Instruct"))
    srv = ServerProcess(home, "--api-key", API_KEY, "--chat-template", str(path), "--parallel", str(PARALLEL))
    srv.wait_ready()
    yield srv
    assert srv.terminate() == 0, srv.stderr
    assert srv.stdout == ""


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=600)


def _ask(client, content: str, **kwargs):
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 40)
    return client.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": content}], **kwargs)


def _alone_then_together(calls: list, together_first: bool = False) -> tuple[list, list]:
    """Run each call alone, one after the other, then all at once (or all at once first); return
    both lists of replies."""
    def at_once() -> list:
        with ThreadPoolExecutor(len(calls)) as pool:
            return list(pool.map(lambda call: call(), calls))

    if together_first:
        together = at_once()
        alone = [call() for call in calls]
    else:
        alone = [call() for call in calls]
        together = at_once()
    return alone, together


def _content(reply) -> tuple:
    message = reply.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
    return message.content, calls, reply.choices[0].finish_reason


def test_the_server_says_how_many_requests_it_answers_at_once(server):
    assert any(f"{PARALLEL} requests at once" in line for line in server.stderr_lines), server.stderr
    meta = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"][0]["meta"]
    assert meta["throughput"] is False  # the exact default


def test_serve_throughput_and_flash_attention_off_say_so_and_answer_requests_together(offline_models, tmp_path):
    """`serve --parallel 2 --throughput --flash-attn off`: the startup line and /v1/models say so,
    the start warns that flash attention off costs passes beside other requests, and two requests
    sent at once through the official client are both answered."""
    srv = ServerProcess(tmp_path, "--parallel", "2", "--throughput", "--flash-attn", "off")
    try:
        srv.wait_ready()
        assert any("2 requests at once, prompts in the passes of their steps (--throughput), flash attention off "
                   "(--flash-attn)" in line for line in srv.stderr_lines), srv.stderr
        assert any("--flash-attn off with 2 requests at once" in line for line in srv.stderr_lines), srv.stderr
        meta = httpx.get(srv.url + "/v1/models").json()["data"][0]["meta"]
        assert meta["throughput"] is True
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=600)
        with ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(lambda q: _ask(client, q, max_tokens=16), QUESTIONS[:2]))
        assert all(r.choices[0].message.content and r.usage.completion_tokens > 0 for r in replies)
    finally:
        assert srv.terminate() == 0, srv.stderr


def test_requests_at_once_answer_as_each_alone_and_share_passes(client):
    calls = [lambda q=q: _ask(client, q) for q in QUESTIONS[:3]]
    # A seeded sampled request: the same draws whatever decodes beside it.
    calls.append(lambda: _ask(client, QUESTIONS[3], temperature=1.0, seed=7))
    # Together first: a greedy request sent again repeats its answer, which the memory of answers
    # drafts whole in a pass or two (decoding.adaptive.REPEAT_MATCH), too few to meet the others'.
    alone, together = _alone_then_together(calls, together_first=True)
    assert [_content(r) for r in together] == [_content(r) for r in alone]
    timings = [r.model_extra["timings"] for r in together[:3]]
    assert all(t["shared_passes"] == 0 for t in (r.model_extra["timings"] for r in alone))
    # The answers were decoded together: passes held several requests' tokens.
    assert sum(t["shared_passes"] for t in timings) > 0, timings
    assert max(t["most_shared"] for t in timings) >= 2, timings


def test_a_batch_mixing_a_schema_a_tool_call_and_chat(client):
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    calls = [
        lambda: _ask(client, "Invent a person.", response_format=schema, max_tokens=48),
        lambda: _ask(client, "What is the weather in Paris?", tools=[WEATHER, ADD], tool_choice="required", max_tokens=48),
        lambda: _ask(client, "Tell me about the moon."),
    ]
    alone, together = _alone_then_together(calls)
    assert [_content(r) for r in together] == [_content(r) for r in alone]
    person = json.loads(together[0].choices[0].message.content)
    assert set(person) == {"name", "age"}
    call = together[1].choices[0].message.tool_calls[0]
    assert call.function.name in ("get_weather", "add") and json.loads(call.function.arguments)


def test_a_short_request_is_not_kept_behind_a_long_prompt(client):
    # A text no request sent before (nothing of it cached): two prefill chunks of up to 512 tokens.
    long_text = "Summarise this list of fruit. " + " ".join(f"Fruit {i} is a line of a long list." for i in range(60))
    first_token: dict[str, float] = {}

    def stream(name: str, content: str, delay: float) -> str:
        time.sleep(delay)
        t0 = time.perf_counter()
        pieces = []
        for chunk in _ask(client, content, max_tokens=8, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                first_token.setdefault(name, time.perf_counter() - t0 + delay)
                pieces.append(chunk.choices[0].delta.content)
        return "".join(pieces)

    with ThreadPoolExecutor(2) as pool:
        long_answer = pool.submit(stream, "long", long_text, 0.0)
        short_answer = pool.submit(stream, "short", QUESTIONS[2], 0.1)
        long_answer, short_answer = long_answer.result(), short_answer.result()
    # The long prompt's chunks were interleaved: the short request's first token came first.
    assert first_token["short"] < first_token["long"], first_token
    alone = _ask(client, long_text, max_tokens=8)
    assert alone.usage.prompt_tokens > 600
    assert long_answer == alone.choices[0].message.content
    assert short_answer == _ask(client, QUESTIONS[2], max_tokens=8).choices[0].message.content


def test_a_request_cancelled_in_a_batch_leaves_the_others_whole(server, client):
    alone = [_content(_ask(client, q)) for q in QUESTIONS[:2]]
    body = {"model": TARGET, "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    left: dict = {}

    def leave_after_a_piece() -> None:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as http:
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line:
                        left["id"] = json.loads(line.removeprefix("data: "))["id"]
                        break

    leaver = threading.Thread(target=leave_after_a_piece)
    leaver.start()
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda q: _content(_ask(client, q)), QUESTIONS[:2]))
    leaver.join(120)
    assert together == alone
    deadline = time.monotonic() + 60
    while not any(left["id"] in line for line in server.stderr_lines) and time.monotonic() < deadline:
        time.sleep(0.1)
    logged = next(line for line in server.stderr_lines if left["id"] in line)
    assert logged.endswith("cancelled"), logged
    assert _content(_ask(client, QUESTIONS[0])) == alone[0]  # and the server goes on answering


def test_a_client_that_reads_slowly_stalls_nobody(server, client):
    """A streaming client that stops reading (its answer decoded on beside the others) holds back
    no other request's passes: another answer comes whole meanwhile, and the slow client later
    reads all of its own, the answer it gets alone."""
    body = {"model": TARGET, "messages": [{"role": "user", "content": QUESTIONS[3]}], "max_tokens": 48,
            "temperature": 0, "stream": True}
    slow_alone = _ask(client, QUESTIONS[3], max_tokens=48).choices[0].message.content
    quick_alone = _content(_ask(client, QUESTIONS[1]))
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            pieces = []
            for line in lines:  # one piece of text, then nothing read for a while
                if line.startswith("data: ") and line != "data: [DONE]":
                    pieces += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
                    if "".join(pieces):
                        break
            assert _content(_ask(client, QUESTIONS[1])) == quick_alone
            for line in lines:
                if line.startswith("data: ") and line != "data: [DONE]":
                    pieces += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
    assert "".join(pieces) == slow_alone


def test_the_queue_position_counts_only_what_waits(server):
    """With free lanes a request does not wait: X-Queue-Position is 0."""
    body = {"model": TARGET, "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 4}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120,
                       headers={"Authorization": f"Bearer {API_KEY}"})
    assert reply.status_code == 200 and reply.headers["X-Queue-Position"] == "0"


# ---------------------------------------------------------------------------------------------
# The engine without a server


HYBRID_PROMPT = "The cat sat on the mat. The dog sat on the log. The cat sat on the"


def test_a_hybrid_target_decodes_two_requests_in_lanes_as_each_alone(offline_models, load_model):
    """Random qwen35 (a recurrent state: chains, rolled back where drafts were rejected), drafted
    by chains that cost no model pass (what a step proposes beside other requests; lookup finds
    nothing in a random model's text, so the chains repeat the prompt): two requests in two lanes
    of one target context, their passes shared, each answer the one decoded alone."""
    model = load_model(tiny_arch_model(MODEL_CACHE, "qwen35"))
    depth, chains, n = 4, 2, 40
    shape = TreeShape(chains * depth, depth, chains, chains)
    prompts = [model.tokenize(HYBRID_PROMPT, add_special=True), model.tokenize(HYBRID_PROMPT + " mat. The", add_special=True)]
    opened: list = []

    def decoder(ctx, lane=None):
        return SpeculativeDecoder(model, ctx, _PromptChains(prompts[0]), shape, lane=lane)

    def tokens(dec, prompt):
        return [t for step in dec.steps(prompt, SamplingParams(), n, make_rng(0)) for t in step.tokens]

    alone_ctx = engine.Context(model, n_ctx=512, n_batch=64, n_seq_max=chains, n_rs_seq=depth, threads=1)
    shared_ctx = engine.Context(model, n_ctx=1024, n_batch=64, n_seq_max=2 * chains, n_rs_seq=depth, threads=1)
    try:
        alone = []
        for prompt in prompts:
            dec = decoder(alone_ctx)
            alone.append(tokens(dec, prompt))
            alone_ctx.clear()
        gate = PassGate(shared_ctx)
        lanes = [Lane(shared_ctx, range(i * chains, (i + 1) * chains), 512, gate) for i in range(2)]
        decoders = [decoder(shared_ctx, lane) for lane in lanes]
        assert _together(decoders, lanes, prompts, tokens) == alone
        assert gate.shared_passes > 0
        # Drafts were rejected and rolled back in the shared passes too.
        assert any(step.shared == 2 and step.tree_nodes > step.accepted for dec in decoders for step in dec.stats.steps)
    finally:
        for ctx in opened:
            ctx.close()
        shared_ctx.close()
        alone_ctx.close()


@pytest.mark.parametrize("network", [False, True], ids=["local", "rpc-filled"])
def test_draft_trees_of_requests_together_share_draft_passes_and_answer_as_alone(offline_models, load_model,
                                                                                 network, monkeypatch):
    """The demo pair, three requests in lanes of one target context and one draft context (a gate
    each, one room): the draft model grows every request's tree while they decode together, its
    passes expanding several requests' trees at once, and each greedy answer is the one decoded
    alone. With `network` the target's passes are filled as over RPC workers (the target context's
    network_s set, counts met before noted): the trees' sum filled to one of them, the filler after
    one request's tree in its first sequence (its colours' branches reach deeper); and the draft
    reads each prompt while the target's pass over it runs (beside it, as if elsewhere) and grows
    each request's tree on during their shared passes."""
    monkeypatch.setattr(counts, "_MET", {})
    target, draft = load_model(offline_models.smollm2_f32), load_model(offline_models.smollm2_q4)
    shape = TreeShape(budget=12, depth=6, width=4, top_k=4)
    # Texts that go on for the whole answer: the draft's trees accept most of their nodes, so a
    # short answer (the QUESTIONS above end after 1-19 tokens) is over in a few steps, alone.
    prompts = [target.tokenize(q, add_special=True) for q in LONG_ANSWERS]
    n = 32
    owned = []

    def context(model, requests: int, batch: int):
        ctx = engine.Context(model, n_ctx=256 * requests, n_batch=batch, n_seq_max=MAX_SEQ, threads=2)
        owned.append(ctx)
        return ctx

    def tokens(dec, prompt):
        return [t for step in dec.steps(prompt, SamplingParams(), n, make_rng(0)) for t in step.tokens]

    try:
        target_ctx, draft_ctx = context(target, 1, 64), context(draft, 1, 64)
        alone = []
        for prompt in prompts:
            grower = TreeGrower(draft, draft_ctx, shape)
            alone.append(tokens(SpeculativeDecoder(target, target_ctx, grower, shape), prompt))
            target_ctx.clear()
            draft_ctx.clear()
        shared_ctx = context(target, 3, 64)
        passes = []  # shared passes: (the requests' tokens, the pass's)
        if network:
            shared_ctx.network_s = 0.05
            passes_a_round_trip_away(shared_ctx)  # (the draft's work meanwhile whatever the load)
            for n_tokens in (9, 17, 25, 33, 41, 49, 57):
                counts.met_counts(target).note(n_tokens, 0.1, tree=True)
        gate, draft_gate, lanes, decoders = _tree_decoders(target, draft, shared_ctx, context(draft, 3, 64), shape, 3)
        for decoder in decoders:  # (as the runtime's where the target runs elsewhere)
            decoder.overlap = network
        run_pass = gate._run

        def recorded(handed, lanes):
            run_pass(handed, lanes)
            if len(handed) > 1:
                passes.append((sum(h.batch.n_tokens for h in handed), handed[0].tokens))

        gate._run = recorded
        assert _together(decoders, lanes, prompts, tokens) == alone
        assert gate.shared_passes > 0 and draft_gate.shared_passes > 0, (gate.shared_passes, draft_gate.shared_passes)
        filled = [(n, total) for n, total in passes if total > n]
        assert bool(filled) == network, passes
        assert all(total in counts.met_counts(target).counts for _, total in filled)
        # Where the target's passes run elsewhere the draft reads each prompt during the prompt's
        # pass (Lane.alone), as a request alone does: its first step catches up with no more.
        assert (sum(decoder.drafter.prepared for decoder in decoders) > 0) == network
        # ... and grows its tree on during the shared passes, for a share of each (PassGate._run).
        assert (sum(decoder.drafter.extended for decoder in decoders) > 0) == network
        # Steps whose target pass held other requests' trees drafted with the draft model too.
        assert any(step.shared > 1 and step.draft_passes > 1 for dec in decoders for step in dec.stats.steps)
        # Each such step told the requests' turns (pay.together) what came without the draft model
        # and its pass's seconds, none shorter than a round trip where the pass runs elsewhere: what
        # bounds leaning, measured only where that bound could pay.
        together = decoders[0].sizer.together
        at_most = together.leaning_at_most(3)
        assert at_most is not None and float(together._free[3].mean) >= 1.0
        if network:
            assert at_most <= 3 * float(together._free[3].mean) / ROUND_TRIP_S
    finally:
        for ctx in owned:
            ctx.close()


class _Recording(LookupDrafter):
    """Lookup as the server's requests lean on it beside others, noting what the decoder told it
    the other requests put into each pass it proposed for."""

    def __init__(self, budget: int, adapt: bool = True):
        super().__init__(budget, adapt=adapt)
        self.besides: list[Beside] = []
        self.shared: list[tuple[int, float]] = []  # (tokens, seconds) of each shared pass it saw

    def propose(self, committed, root, budget, depth):
        self.besides.append(self.beside)
        return super().propose(committed, root, budget, depth)

    def observe_shared(self, n_tokens: int, seconds: float) -> None:
        self.shared.append((n_tokens, seconds))
        super().observe_shared(n_tokens, seconds)


def test_requests_together_size_their_trees_by_what_the_others_put_into_the_pass(offline_models, load_model):
    """One budget across requests (pay.rules.best_size): each request posts what its steps put
    into a pass and emitted from it; one decoding beside others sizes its tree against the pass
    they share, as the others posted it; and each greedy answer is the one decoded alone."""
    target = load_model(offline_models.smollm2_f32)
    shape = TreeShape(budget=16, depth=8, width=4, top_k=4)
    # The others' texts go on for the whole answer, so that the first one's copy (lookup trees)
    # meets passes the others share: QUESTIONS' answers ended after 13-19 tokens, and a busy
    # moment could leave the copy alone in its passes.
    texts = ["Repeat this line twice: the quick brown fox jumps over the lazy dog, the quick brown fox",
             LONG_ANSWERS[0], LONG_ANSWERS[1]]
    prompts = [target.tokenize(q, add_special=True) for q in texts]
    n, per = 40, MAX_SEQ // len(prompts)

    def tokens(dec, prompt):
        return [t for step in dec.steps(prompt, SamplingParams(), n, make_rng(0)) for t in step.tokens]

    ctx = engine.Context(target, n_ctx=256 * len(prompts), n_batch=64, n_seq_max=MAX_SEQ, threads=2)
    try:
        alone = []
        for prompt in prompts:
            ctx.clear()
            alone.append(tokens(SpeculativeDecoder(target, ctx, _Recording(16), shape), prompt))
        ctx.clear()
        gate = PassGate(ctx)
        lanes = [Lane(ctx, range(i * per, (i + 1) * per), 256, gate) for i in range(len(prompts))]
        # The copy proposes its lookup trees whatever they measure to pay (in two of four full
        # suites, sized by the run's clock, none met a shared pass); the others size theirs.
        decoders = [SpeculativeDecoder(target, ctx, _Recording(16, adapt=i > 0), shape, lane=lane)
                    for i, lane in enumerate(lanes)]
        assert _together(decoders, lanes, prompts, tokens) == alone
        assert gate.shared_passes > 0
        posts = gate.room.posts
        assert set(posts) == set(lanes)
        for lane, dec in zip(lanes, decoders):
            put, emitted = posts[lane]
            assert put >= emitted >= 1.0, posts[lane]
            # Proposals made beside others were weighed against the others' tokens in the pass:
            # at least one plain step (one token each) per other request decoding then.
            beside = [b for b in dec.drafter.besides if b.tokens > 0]
            assert beside and all(b.tokens >= 1.0 and b.emitted >= 1.0 for b in beside), dec.drafter.besides
        # Each shared pass's seconds over all its tokens went into the drafters' cost curves:
        # the pass held the others' tokens too (a request's root and the others' at least).
        for dec in decoders:
            assert dec.drafter.shared and all(n >= 2 and s > 0 for n, s in dec.drafter.shared), dec.drafter.shared
            assert dec.drafter.cost.known
        assert any(n > 1 + max(1, len(lanes) - 1) for dec in decoders for n, _ in dec.drafter.shared)
        # A request alone is sized alone.
        assert decoders[0].sizer.beside(lanes[0]) == ALONE
    finally:
        ctx.close()


def test_with_throughput_a_prompt_goes_into_the_passes_of_the_others_steps(offline_models, load_model):
    """--throughput (Lane.prompts_join): a prompt's chunks go into passes that hold the other
    requests' steps, not passes of their own; its KV is then no fresh prefill's (none of it
    counts as exact for a later greedy prompt); a reproducible request's prompt keeps passes of
    its own. In the exact default no pass holds a prompt's chunk beside another request's tokens."""
    target = load_model(offline_models.smollm2_f32)
    long_prompt = target.tokenize("Summarise this list. " + " ".join(f"Item {i} is a thing." for i in range(20)), add_special=True)
    short_prompt = target.tokenize(QUESTIONS[3], add_special=True)
    assert len(long_prompt) > 64  # more than a batch: several chunks
    prompts, per = [short_prompt, long_prompt], MAX_SEQ // 2
    ctx = engine.Context(target, n_ctx=512, n_batch=64, n_seq_max=MAX_SEQ, threads=2)

    def run(join: bool, params: SamplingParams):
        ctx.clear()
        gate = PassGate(ctx)
        passes: list[list[tuple[int, int]]] = []  # each pass: (lane's base sequence, tokens) per request
        run_pass = gate._run

        def recorded(handed, lanes):
            passes.append([(int(h.batch.seq_ids[0, 0]), h.batch.n_tokens) for h in handed])
            run_pass(handed, lanes)

        gate._run = recorded
        lanes = [Lane(ctx, range(i * per, (i + 1) * per), 256, gate, prompts_join=join) for i in range(2)]
        decoders = [PlainDecoder(target, ctx, lane=lane) for lane in lanes]
        kinds = [SamplingParams(), params]

        def tokens(dec, prompt):
            i = decoders.index(dec)
            return [t for step in dec.steps(prompt, kinds[i], 24, make_rng(0)) for t in step.tokens]

        answers = _together(decoders, lanes, prompts, tokens)
        assert all(len(a) == 24 for a in answers), answers
        # The long prompt's chunks (its lane's batches of more than one token) and whom they met.
        chunks = [p for p in passes if any(base == lanes[1].base and n > 1 for base, n in p)]
        assert chunks
        return [len(p) for p in chunks], decoders[1].cache.n_exact

    whole_batches = 64 * (len(long_prompt) // 64)
    shared, n_exact = run(False, SamplingParams())
    assert set(shared) == {1} and n_exact == whole_batches  # passes of its own, its whole batches exact
    shared, n_exact = run(True, SamplingParams())
    assert max(shared) == 2 and n_exact == 0  # beside the other request's steps; nothing exact
    shared, n_exact = run(True, SamplingParams(pinned=True))
    assert set(shared) == {1} and n_exact == whole_batches  # a reproducible request's prompt: passes of its own
    ctx.close()


def test_a_request_edits_its_lane_only_while_no_pass_runs(offline_models, load_model):
    """llama.cpp's cache must not be edited while a pass reads it: a request that takes its lane
    (join) waits for a pass that runs, and from then on holds the others' passes back until it
    waits at the gate or leaves, so its edits (a prompt trimmed, a tree's branch kept) never meet
    a pass."""
    model = load_model(offline_models.smollm2_q4)
    ctx = engine.Context(model, n_ctx=512, n_batch=32, n_seq_max=4, threads=1)
    entered, release = threading.Event(), threading.Event()
    try:
        gate = PassGate(ctx)
        a, b = Lane(ctx, range(0, 2), 256, gate), Lane(ctx, range(2, 4), 256, gate)
        prompt = model.tokenize("The cat sat on the", add_special=True)
        decode = ctx.decode

        def held(batch):  # the pass runs until the test lets it end
            entered.set()
            release.wait(60)
            decode(batch)

        ctx.decode = held

        def pass_of_a(tokens, start):
            batch = engine.Batch(32, MAX_SEQ)
            batch.set_sequence(tokens, start, a.base, "last")
            thread = threading.Thread(target=a.run, args=(batch,))
            thread.start()
            return thread

        a.join()
        first = pass_of_a(prompt, 0)
        assert entered.wait(60)
        joined = threading.Event()
        threading.Thread(target=lambda: (b.join(), joined.set())).start()
        time.sleep(0.3)
        assert not joined.is_set()  # b waits while a's pass runs
        release.set()
        first.join(60)
        assert joined.wait(60)
        entered.clear()
        second = pass_of_a(prompt[-1:], len(prompt))
        time.sleep(0.3)
        assert not entered.is_set()  # b took its lane and is not waiting: a's pass waits
        b.clear()  # b edits its cache while nothing runs
        b.leave()
        second.join(60)
        assert entered.is_set() and not second.is_alive()
    finally:
        release.set()
        ctx.close()


@pytest.mark.slow
@pytest.mark.parametrize("split", [False, True], ids=["one-cache", "kv-split"])
def test_sampling_through_draft_trees_in_shared_passes_has_the_plain_distribution(offline_models, load_model, split):
    """Chi-square: at T=1 the first tokens two requests sample through draft-model trees, their
    target passes shared (and their draft passes where they meet), follow plain sampling's
    distribution (promise 1 holds beside other requests too); with a cache per request
    (--kv-split) each verifies its tree's best chain.

    The tiny random model is the target and its own draft, as in test_speculative's sampled tests
    (the walk and the gates do not care which model made the logits): 2000 samples a side in less
    time than 200 of the demo pair took (70 s)."""
    from scipy.stats import chi2_contingency

    target = draft = load_model(offline_models.smollm2_random)
    shape = TreeShape(budget=8, depth=4, width=4, top_k=4)
    params, per_lane = SamplingParams(temperature=1.0), 1000
    prompt = target.tokenize("Once upon a time, in a small village,", add_special=True)
    owned = []

    def context(model, requests: int, batch: int = 64, split: bool = False):
        ctx = engine.Context(model, n_ctx=256 * requests, n_batch=batch, n_seq_max=requests if split else MAX_SEQ,
                             threads=1, kv_unified=not split)
        owned.append(ctx)
        return ctx

    try:
        plain = PlainDecoder(target, context(target, 1))
        rng = make_rng(1)
        plain_samples = [first_tokens(plain, prompt, params, rng) for _ in range(2 * per_lane)]
        gate, _, lanes, decoders = _tree_decoders(target, draft, context(target, 2, split=split), context(draft, 2),
                                                  shape, 2)
        assert all(d.chain_only for d in decoders) is split
        shared_drafted = [0, 0]

        def sample(i: int) -> list:
            rng, out = make_rng(10 + i), []
            for _ in range(per_lane):
                out.append(first_tokens(decoders[i], prompt, params, rng))
                shared_drafted[i] += sum(s.accepted for s in decoders[i].stats.steps if s.shared > 1)
            return out

        results = _together(decoders, lanes, [None, None], lambda dec, _: sample(decoders.index(dec)))
        spec_samples = results[0] + results[1]
        table = binned(plain_samples, spec_samples)
        p_value = chi2_contingency(table).pvalue
        print(f"\n{len(spec_samples)} samples, {table.shape[1]} bins, p = {p_value:.3g}, "
              f"draft tokens accepted in shared passes {shared_drafted}")
        assert gate.shared_passes > 0
        assert sum(shared_drafted) > per_lane / 4, "drafts accepted in shared passes should exercise acceptance"
        assert table.shape[1] >= 5
        assert p_value >= 1e-3, f"sampling in shared passes differs from plain sampling (p = {p_value:.2g})\n{table}"
    finally:
        for ctx in owned:
            ctx.close()


def _tree_decoders(target, draft, target_ctx, draft_ctx, shape, n: int):
    """n requests' lanes of one target and one draft context (a gate each, one room), each with a
    decoder whose draft-model trees are grown in its draft lane, drafting with the model beside the
    others (one turn, the first); return (gate, draft gate, target lanes, decoders)."""
    per, target_per = MAX_SEQ // n, target_ctx.n_seq_max // n  # (a cache per request: one sequence each)
    gate = PassGate(target_ctx)
    draft_gate = PassGate(draft_ctx, gate.room, first=True)
    lanes = [Lane(target_ctx, range(i * target_per, (i + 1) * target_per), 256, gate) for i in range(n)]
    draft_lanes = [Lane(draft_ctx, range(i * per, (i + 1) * per), 256, draft_gate) for i in range(n)]
    together = Together(window=10**6)
    decoders = [SpeculativeDecoder(target, target_ctx, TreeGrower(draft, draft_ctx, shape, d), shape, lane=lane,
                                   together=together) for lane, d in zip(lanes, draft_lanes)]
    return gate, draft_gate, lanes, decoders


def test_over_rpc_workers_a_shared_pass_is_filled_to_a_count_met_before(offline_models, load_model, monkeypatch):
    """Over RPC workers (Context.network_s, set here on a local context) a pass over a count of
    tokens the process has not met costs round trips, and a shared pass holds the sum of its
    requests' tokens: the gate fills it to a count met before, its rows of logits to a count met
    before too (PassGate._fill). The filler's cells are given back after each pass, and every
    answer is the one decoded without filler."""
    monkeypatch.setattr(counts, "_MET", {})
    target = load_model(offline_models.smollm2_f32)
    prompts = [target.tokenize(q, add_special=True) for q in (QUESTIONS[1], QUESTIONS[3])]
    per = MAX_SEQ // 2
    ctx = engine.Context(target, n_ctx=512, n_batch=64, n_seq_max=MAX_SEQ, threads=2)
    met = counts.met_counts(target)
    met.note(6, 0.1, tree=True)  # a 5-node tree's pass, met before: 6 tokens, 6 rows of logits

    def run(network_s: float):
        ctx.clear()
        ctx.network_s = network_s
        gate = PassGate(ctx)
        passes = []  # shared passes: (the requests' tokens, the pass's tokens, each lane's cells past its batch)
        run_pass = gate._run

        def recorded(handed, lanes):
            run_pass(handed, lanes)
            if len(handed) > 1:
                past = [ctx.seq_pos_max(lane.base) - int(h.batch.positions[: h.batch.n_tokens].max())
                        for lane, h in zip(lanes, handed)]
                passes.append((sum(h.batch.n_tokens for h in handed), handed[0].tokens, past))

        gate._run = recorded
        lanes = [Lane(ctx, range(i * per, (i + 1) * per), 256, gate) for i in range(2)]
        decoders = [PlainDecoder(target, ctx, lane=lane) for lane in lanes]

        def tokens(dec, prompt):
            return [t for step in dec.steps(prompt, SamplingParams(), 16, make_rng(0)) for t in step.tokens]

        return _together(decoders, lanes, prompts, tokens), passes

    plain, unfilled = run(0.0)
    answers, filled = run(0.05)
    assert min(len(a) for a in plain) > 8 and answers == plain
    assert unfilled and all(n == total for n, total, _ in unfilled)
    assert filled and all(n == 2 and total == 6 for n, total, _ in filled)  # two plain steps, filled to 6
    assert all(past == [0, 0] for _, _, past in filled)  # no filler cell left behind
    assert met.rows == {0, 1, 6} and 2 not in met.counts  # 6 rows asked, as the count's tree pass did; no pass of 2
    ctx.network_s = 0.0
    ctx.close()


def test_over_rpc_workers_the_start_up_probe_notes_the_counts_it_met(offline_models, load_model, monkeypatch):
    """The target's passes timed at start (kv.probe_context: one token, and a tree's all rows)
    are counts the worker has met: the next passes are filled to them, priced by those timings.
    Not noted, a 200 ms worker's first shared pass of two chains met a new count (2.1 s) beside a
    6-token tree count the probe had met. Without a network nothing is noted."""
    from specrun.decoding.kv import probe_context

    monkeypatch.setattr(counts, "_MET", {})
    target = load_model(offline_models.smollm2_f32)
    ctx = engine.Context(target, n_ctx=256, n_batch=64, threads=2)
    met = counts.met_counts(target)
    assert probe_context(ctx, (1, 6), repeats=2, logits="all") and 6 not in met.counts
    ctx.network_s = 0.05
    assert probe_context(ctx, (1, 6), repeats=2, logits="all")
    assert 6 in met.tree_counts and 6 in met.rows and met.fill_to(4, 63, 0.05, tree=True) == 6
    # The warm-up's pass is no price; each count's first pass is none either (the worker's round
    # trips): both passes of one token are timed, the second of six.
    assert met._seconds[1].count == 2 and met._seconds[6].count == 1
    ctx.network_s = 0.0
    ctx.close()


def test_a_shared_pass_s_filler_goes_on_from_the_last_position_of_its_sequence(offline_models, load_model, monkeypatch):
    """llama.cpp takes a sequence's tokens in a batch only at unbroken positions: the filler of a
    shared pass (PassGate._fill) goes on from its sequence's last token, not from the deepest of the
    tree's branches, which sit in other sequences. A tree whose first sequence holds one node and
    whose second holds three below the root: the pass is filled, its rows are those of the pass
    without filler, and no filler cell is left."""
    monkeypatch.setattr(counts, "_MET", {})
    target = load_model(offline_models.smollm2_f32)
    ctx = engine.Context(target, n_ctx=512, n_batch=64, n_seq_max=8, threads=2)

    def shared_pass(network_s: float) -> tuple[list, int]:
        ctx.clear()
        ctx.network_s = network_s
        gate = PassGate(ctx)
        lanes = [Lane(ctx, range(0, 4), 256, gate), Lane(ctx, range(4, 8), 64, gate)]  # the first has more room
        prefix = Batch(2, 1)
        for lane in lanes:
            prefix.set_sequence([1, 2], 0, lane.base, "none")
            ctx.decode(prefix)
        ctx.seq_cp(0, 1, -1, -1)
        tree, step = Batch(8, 4), Batch(8, 4)
        tree.add(10, 2, (0, 1), True)  # the root, in both of the tree's sequences
        tree.add(11, 3, (0,), True)
        for i, token in enumerate((12, 13, 14)):
            tree.add(token, 3 + i, (1,), True)
        step.add(20, 2, (4,), True)
        handed = [_Handed(tree, False), _Handed(step, False)]
        gate._run(handed, lanes)
        rows = [h.rows.copy() for h in handed]
        assert ctx.seq_pos_max(0) == 3 and ctx.seq_pos_max(1) == 5 and ctx.seq_pos_max(4) == 2
        return rows, handed[0].tokens

    counts.met_counts(target).note(9, 0.1, tree=True)
    alone, n_alone = shared_pass(0.0)
    filled, n_filled = shared_pass(0.05)
    assert (n_alone, n_filled) == (6, 9)
    assert all(np.array_equal(a, b) for a, b in zip(alone, filled))
    ctx.network_s = 0.0
    ctx.close()


def _together(decoders, lanes, prompts, tokens) -> list:
    """Decode prompt i with decoder i, each in a thread of its own (its lane left at the end);
    return what each decoded."""
    results: list = [None] * len(decoders)

    def run(i: int) -> None:
        lanes[i].join()  # as a request that takes its decoder from the pool
        try:
            results[i] = tokens(decoders[i], prompts[i])
        finally:
            lanes[i].leave()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(decoders))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


class _PromptChains(Drafter):
    """Proposes, below the root, the prompt's tokens that followed the root's last occurrence there
    (or its first tokens): chains that are often wrong, with no model pass."""

    def __init__(self, prompt: list[int]):
        self.prompt = prompt

    def propose(self, committed, root, budget, depth):
        start = max((i + 1 for i, t in enumerate(self.prompt[:-1]) if t == root), default=0)
        chain = self.prompt[start: start + min(budget, depth)] or self.prompt[:1]
        return Proposal(DraftTree.chain(root, chain))

    propose_free = propose

    def commit(self, proposal, accepted_nodes) -> None:
        pass


def test_the_plan_for_n_requests_is_what_llama_cpp_allocates(offline_models, monkeypatch):
    from specrun.runtime import drafters as drafting

    probed = []  # (the target's passes timed at start, by every lane's drafter)
    real_probe = drafting.probe_context
    monkeypatch.setattr(drafting, "probe_context", lambda ctx, *a, **k: probed.append(ctx) or real_probe(ctx, *a, **k))
    opts = RunOptions(target="smollm2-135m-f32", draft="smollm2-135m-q4", ctx_size=1024, parallel=3, quiet=True)
    with Runtime(opts) as rt:
        # The target's passes are timed once for the three lanes (one context), and each lane's
        # drafter starts from those figures (200 ms from an RPC worker each probe took 2.2 s).
        assert probed == [rt.target_ctx]
        hybrids = [d.drafter for d in rt.decoders]
        assert all(h.best_case is not None for h in hybrids)
        assert len({(h.best_case.plain_s, h.best_case.tree_s) for h in hybrids}) == 1
        assert len({h.cost.plain_s() for h in hybrids}) == 1
        planned = rt.plan.placement.breakdown
        assert rt.plan.target_ctx.cells == 3 * 1024 and rt.plan.draft_ctx.cells == 3 * 1024
        assert len(rt.decoders) == 3 and len({d.cache.lane.base for d in rt.decoders}) == 3
        # One draft context, a lane of it each, its gate in the target gate's room.
        drafters = [getattr(d.drafter, "draft", d.drafter) for d in rt.decoders]
        assert len({g.lane.base for g in drafters}) == 3 and {g.ctx for g in drafters} == {rt.draft_ctx}
        assert drafters[0].lane.gate.room is rt.decoders[0].lane.gate.room
        # On a CPU the requests do not draft with the model beside one another (pay.rules.draft_together).
        assert all(d.sizer.together is None for d in rt.decoders)
        context = sum(p.context for p in planned)
        everything = sum(p.total for p in planned)
        assert abs(context - rt.allocation.context) <= 0.05 * rt.allocation.context, (context, rt.allocation)
        allocated = rt.allocation.total - rt.allocation.repacked
        assert abs(everything - allocated) <= 0.05 * allocated, (everything, rt.allocation)


def test_generate_jsonl_decodes_lines_together_in_input_order(cli):
    lines = [json.dumps({"id": f"q{i}", "prompt": q}) for i, q in enumerate(QUESTIONS)]
    lines.insert(2, "{not json")  # a bad line keeps its place and stops nothing
    args = ["generate", "--jsonl", "-n", "24", "--ctx-size", "1024"]
    alone = cli(*args, input="\n".join(lines) + "\n")
    together = cli(*args, "--parallel", "3", input="\n".join(lines) + "\n")
    assert alone.exit_code == 0 and together.exit_code == 0, together.output
    one, many = [json.loads(x) for x in alone.stdout.splitlines()], [json.loads(x) for x in together.stdout.splitlines()]
    assert [r.get("id") for r in many] == ["q0", "q1", None, "q2", "q3"]
    assert "error" in many[2] and many[2]["line"] == 3
    assert [r.get("text") for r in many] == [r.get("text") for r in one]
    assert [r.get("token_ids") for r in many] == [r.get("token_ids") for r in one]
    assert sum(step_shared(r) for r in many) > 0  # lines did decode together
    # --throughput: the same lines, prompts in the passes of the others' steps.
    fast = cli(*args, "--parallel", "3", "--throughput", input="\n".join(lines) + "\n")
    assert fast.exit_code == 0, fast.output
    fast_results = [json.loads(x) for x in fast.stdout.splitlines()]
    assert [r.get("id") for r in fast_results] == ["q0", "q1", None, "q2", "q3"]
    assert all(len(r["token_ids"]) == 24 or r["stats"]["finish_reason"] == "eog" for r in fast_results if "error" not in r)
    assert sum(step_shared(r) for r in fast_results) > 0


def step_shared(result: dict) -> int:
    return result.get("stats", {}).get("shared_passes", 0)


def test_generate_refuses_parallel_without_jsonl(cli):
    result = cli("generate", "--parallel", "2", "hello")
    assert result.exit_code == 2
    assert "--parallel needs --jsonl" in result.output
    result = cli("generate", "--throughput", "hello")
    assert result.exit_code == 2
    assert "--throughput needs --jsonl" in result.output


def test_plan_parallel_shows_the_cells_of_each_context(cli):
    result = cli("plan", "--parallel", "3", "--ctx-size", "1024", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    target, draft = plan["contexts"]["target"], plan["contexts"]["draft"]
    assert (target["parallel"], target["cells"], target["n_ctx"]) == (3, 3072, 1024)
    assert (draft["parallel"], draft["cells"]) == (3, 3072) and plan["context"]["n_ctx"] == 1024
    text = cli("plan", "--parallel", "3", "--ctx-size", "1024")
    assert "3 requests at once: 3072 KV cells (1024 each)" in text.stdout
