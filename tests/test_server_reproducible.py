"""A request's `"reproducible": true` and `specrun serve --reproducible`: the request is decoded as
`generate --reproducible` decodes it (a fresh prefill, then one-token passes of its own), so a
greedy answer is plain decoding's, token for token and log-prob for log-prob, with the draft model
loaded and beside other requests (docs/exactness.md#the-same-answer-under-any-load---reproducible).

Three servers of the demo pair, alike but for what is tested: one that speculates, the same under
`--reproducible`, and plain decoding (`--no-spec`), whose answers are the reference. One thread
each: a pass's rounding may follow how its work is split between threads.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from test_server import running_server

from specrun import engine
from specrun.server.ollama import ChatBody

ALIKE = ("--threads", "1", "--parallel", "2")
N_TOKENS = 24
STORY = "Tell me a short story about a lighthouse keeper."
# Where chains round as one-token passes do (a build without llamafile), a reproducible greedy
# request keeps chain speculation; elsewhere it decodes one token a pass (docs/exactness.md).
CHAINS = engine.runs_batch_invariant()
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def speculating(offline_models, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("serve-spec"), *ALIKE) as srv:
        yield srv


@pytest.fixture(scope="module")
def plain(offline_models, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("serve-plain"), "--no-spec", *ALIKE) as srv:
        yield srv


@pytest.fixture(scope="module")
def pinned(offline_models, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("serve-pinned"), "--reproducible", *ALIKE) as srv:
        yield srv


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _ask(server, content: str = STORY, **fields) -> tuple[list[tuple[str, float]], dict]:
    """Return a greedy chat answer's tokens with their log-probs, and its timings; `fields` go in
    the body as sent."""
    extra = {name: fields.pop(name) for name in ("reproducible",) if name in fields}
    reply = _client(server).chat.completions.create(
        model="specrun", messages=[{"role": "user", "content": content}], max_tokens=N_TOKENS, temperature=0,
        logprobs=True, extra_body=extra or None, **fields)
    return [(t.token, t.logprob) for t in reply.choices[0].logprobs.content], reply.model_extra["timings"]


def test_a_reproducible_request_is_plain_decoding_beside_one_that_speculates(speculating, plain):
    reference, plain_timings = _ask(plain)
    _, free = _ask(speculating)
    assert free["draft_n"] > 0  # this server verifies trees for a request that does not ask
    with ThreadPoolExecutor(1) as pool:
        beside = pool.submit(_ask, speculating, "Write a list of five fruits.")
        ours, timings = _ask(speculating, reproducible=True)
        beside.result()
    assert ours == reference
    assert timings["shared_passes"] == 0  # passes of its own
    assert (timings["draft_n"] > 0) is CHAINS  # no tree, or chains alone
    assert (timings["n_passes"] < plain_timings["n_passes"]) is CHAINS


def test_a_reproducible_json_answer_verifies_no_forced_run(speculating, plain):
    """A schema's forced runs (keys, braces) are free drafts, verified several tokens a pass: a
    reproducible request takes them one token a pass, as plain decoding does."""
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    ask = "Invent a person: give a name and an age."
    reference, _ = _ask(plain, ask, response_format=schema)
    _, free = _ask(speculating, ask, response_format=schema)
    assert free["draft_n"] > 0
    ours, timings = _ask(speculating, ask, response_format=schema, reproducible=True)
    assert ours == reference and (timings["draft_n"] > 0) is CHAINS


def test_serve_reproducible_decodes_every_request_so(pinned, plain):
    assert any("every request reproducible" in line for line in pinned.stderr_lines), pinned.stderr
    # Beside other requests an f16 cache rounds by where a request's cells sit: it says what keeps them apart.
    assert any("--kv-type q8_0 does not" in line for line in pinned.stderr_lines), pinned.stderr
    # One-token passes need no draft model, and the server loads none (chains keep theirs).
    ready = next(line for line in pinned.stderr_lines if "every request reproducible" in line)
    assert ("smollm2-135m-q4" in ready) is CHAINS and ("greedy in chains" in ready) is CHAINS, ready
    for server, reproducible in ((pinned, True), (plain, False)):  # /v1/models says which it is
        [entry] = _client(server).models.list().data
        assert entry.model_extra["meta"]["reproducible"] is reproducible
    reference, _ = _ask(plain)
    for fields in ({}, {"reproducible": False}):  # the field cannot turn it off
        ours, timings = _ask(pinned, **fields)
        assert ours == reference and (timings["draft_n"] > 0) is CHAINS, fields


def test_serve_reproducible_prefills_every_prompt_afresh(pinned, plain):
    """A sampled prompt sent again finds its text in the cache: the server reuses it, but under
    --reproducible it is evaluated again, and the answer says so."""
    def cached(server) -> list[int]:
        replies = [_client(server).completions.create(model="specrun", prompt=STORY, max_tokens=2, temperature=1.0)
                   for _ in range(2)]
        return [reply.model_extra["timings"]["cache_n"] for reply in replies]

    assert cached(plain)[1] > 0
    assert cached(pinned) == [0, 0]


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_reproducible_is_true_or_false_only(speculating, value):
    client = _client(speculating)
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model="specrun", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"reproducible": value})
    with pytest.raises(openai.BadRequestError) as completion:
        client.completions.create(model="specrun", prompt="hi", max_tokens=2, extra_body={"reproducible": value})
    for error in (chat.value, completion.value):
        assert error.status_code == 400 and error.body["param"] == "reproducible", error.body
        assert error.body["message"].startswith("reproducible: must be true or false, got "), error.body
    ollama = httpx.post(speculating.url + "/api/generate", timeout=60,
                        json={"model": "specrun", "prompt": "hi", "stream": False, "options": {"reproducible": value}})
    assert ollama.status_code == 400
    assert ollama.json()["error"].startswith("options.reproducible: must be true or false, got "), ollama.text


def test_ollama_options_ask_for_a_reproducible_answer():
    body = ChatBody.model_validate({"messages": [{"role": "user", "content": "hi"}], "options": {"reproducible": True}})
    assert body.options.request(None).reproducible
    assert not ChatBody.model_validate({"messages": []}).options.request(None).reproducible


# A draft model cheaper than the target (random weights: the hybrid's lookup does the drafting on
# a text that repeats itself), so that speculation pays.
LIST = "Copy this list exactly, twice: apples, pears, plums, grapes, cherries, lemons, limes, figs, dates, kiwis."
Q4_QUANTIZED = ("--target", "smollm2-135m-q4", "--draft", "smollm2-tiny-random", "--kv-type", "q8_0", "--threads", "1", "--parallel", "1")


def test_serve_reproducible_keeps_its_draft_where_a_quantized_cache_measures_chains_exact(tmp_path_factory):
    """A Q4_1 target over a q8_0 cache scores a tree's first path as one-token passes (measured at
    start: decoding.kv.chains_exact), so --reproducible keeps the draft model and its greedy
    requests verify chains, plain decoding's answer bit for bit."""
    with running_server(tmp_path_factory.mktemp("serve-q4-plain"), "--no-spec", *Q4_QUANTIZED) as plain_q4:
        reference, _ = _ask(plain_q4, LIST)
    with running_server(tmp_path_factory.mktemp("serve-q4-pinned"), "--reproducible", *Q4_QUANTIZED) as pinned_q4:
        ready = next(line for line in pinned_q4.stderr_lines if "every request reproducible" in line)
        assert "greedy in chains that verify as one-token passes" in ready and "smollm2-tiny-random" in ready, ready
        ours, timings = _ask(pinned_q4, LIST)
    assert ours == reference and timings["draft_n"] > 0


def test_serve_reproducible_loads_no_draft_where_chains_measure_otherwise(tmp_path_factory):
    """The F32 demo target over a q8_0 cache: where its chains round unlike its one-token passes
    (the default build: llamafile's kernels from two tokens on), every request of a reproducible
    server decodes one token a pass, so the draft model is not loaded and no warning about
    speculation's answers is shown; where they measure exact (a build without llamafile) it stays."""
    f32_quantized = ("--kv-type", "q8_0", "--threads", "1", "--parallel", "1")
    with running_server(tmp_path_factory.mktemp("serve-f32-q8"), "--reproducible", *f32_quantized) as srv:
        ready = next(line for line in srv.stderr_lines if "every request reproducible" in line)
        answer, timings = _ask(srv, LIST)
    chains = "greedy in chains that verify as one-token passes" in ready
    assert chains is CHAINS, ready
    if chains:
        assert "smollm2-135m-q4" in ready, ready
    else:
        assert "one token each" in ready and "without a draft (plain decoding)" in ready, ready
        assert not any("with speculation" in line or "memory plan is off" in line for line in srv.stderr_lines), srv.stderr
        assert timings["draft_n"] == 0 and len(answer) == N_TOKENS


def test_serve_reproducible_takes_any_drafter_option(plain, tmp_path_factory):
    """--reproducible beside --draft lookup: where nothing may draft, the server decodes plainly
    rather than refusing the pair of options, and answers as plain decoding does."""
    with running_server(tmp_path_factory.mktemp("serve-pinned-lookup"), "--reproducible", "--draft", "lookup", *ALIKE) as srv:
        ready = next(line for line in srv.stderr_lines if "every request reproducible" in line)
        ours, _ = _ask(srv, LIST)
    assert ("greedy in chains" in ready) is CHAINS, ready
    reference, _ = _ask(plain, LIST)
    assert [token for token, _ in ours] == [token for token, _ in reference]


def test_a_reproducible_server_fetches_no_draft_it_will_not_load(monkeypatch):
    # `serve` fetches what is missing before it binds the port; where every request decodes one
    # token a pass (no chain may verify exactly) that is not the draft model, which never loads.
    from specrun.errors import UsageError
    from specrun.runtime.plan import RunOptions
    from specrun.server import serve
    from specrun.server.app import ServerSettings

    fetched = []

    def resolve_models(opts):  # where the fetch starts: note what it is asked for, go no further
        fetched.append(opts)
        raise UsageError("stopped before fetching")

    monkeypatch.setattr(serve, "resolve_models", resolve_models)
    opts = RunOptions(target="smollm2-135m-f32", draft="smollm2-135m-q4")
    for reproducible in (False, True):
        with pytest.raises(UsageError):
            serve.serve(opts, "127.0.0.1", 0, ServerSettings(reproducible=reproducible), queue_size=4)
    asked, pinned = fetched
    assert asked.draft == "smollm2-135m-q4"
    assert pinned.draft == (None if not engine.chains_may_match() else "smollm2-135m-q4")
