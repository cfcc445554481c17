"""A reasoning model's thinking through `specrun serve`: a real server on the demo pair, rendering
with Qwen3.5's real chat template (--chat-template), which opens `<think>` in the generation
prompt, so everything the model writes until `</think>` is thinking.

A three-turn conversation keeps reasoning_content out of content, is accepted with the thinking
sent back on assistant turns (as Open WebUI does) and reuses the KV cache; reasoning_format and
chat_template_kwargs (enable_thinking) switch the split and the thinking off per request.
"""

from __future__ import annotations

import openai
import pytest
from pinned_sources import template
from test_server import API_KEY, TARGET, running_server

ollama = pytest.importorskip("ollama", reason="the ollama client library is not installed (dev extra)")

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def server(offline_models, tmp_path_factory):
    home = tmp_path_factory.mktemp("serve-reasoning")
    path = home / "qwen35.jinja"
    path.write_text(template("Qwen3.5-4B"))
    with running_server(home, "--api-key", API_KEY, "--chat-template", str(path)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=600)


def _ask(client, messages, **extra):
    return client.chat.completions.create(model=TARGET, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body=extra or None)


def test_three_turns_keep_thinking_apart_and_reuse_the_cache(client):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    previous_prompt = None
    for turn, question in enumerate(["What is 2+2?", "And 3+3?", "And 4+4?"]):
        if turn:
            messages.append({"role": "user", "content": question})
            # Earlier turns render without their thinking, so the cache holds the conversation up to
            # the last assistant turn's opening: all of the previous prompt but its "<think>\n". A
            # sampled request reuses all of that.
            sampled = client.chat.completions.create(model=TARGET, messages=messages, max_tokens=MAX_TOKENS,
                                                     temperature=0.8)
            cached = sampled.usage.prompt_tokens_details.cached_tokens
            assert previous_prompt - 8 <= cached < sampled.usage.prompt_tokens
        reply = _ask(client, messages)
        # A greedy one reuses whole batches of an earlier prompt only: it is evaluated as in an
        # empty cache (issue 37, item 8).
        assert reply.usage.prompt_tokens_details.cached_tokens % 512 == 0
        message = reply.choices[0].message
        thinking = message.model_extra.get("reasoning_content")
        # The prompt opened <think> and this model never closes it: all of it is thinking.
        assert thinking and not message.content
        raw = _ask(client, messages, reasoning_format="none").choices[0].message
        assert "reasoning_content" not in (raw.model_extra or {})
        assert raw.content.strip() == thinking  # the same greedy text, left whole in content
        previous_prompt = reply.usage.prompt_tokens
        # Sent back as Open WebUI does: the thinking beside an (empty) answer.
        messages.append({"role": "assistant", "content": message.content or "", "reasoning_content": thinking})


def test_streamed_thinking_arrives_in_reasoning_deltas(client):
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = _ask(client, messages).choices[0].message.model_extra["reasoning_content"]
    stream = client.chat.completions.create(model=TARGET, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    thinking, content = [], []
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            thinking.append((delta.model_extra or {}).get("reasoning_content") or "")
            content.append(delta.content or "")
    assert "".join(thinking).strip() == whole and not "".join(content)
    assert sum(1 for t in thinking if t) >= 2  # streamed as it comes, not at the end


def test_enable_thinking_false_goes_to_the_template(client):
    reply = _ask(client, [{"role": "user", "content": "Name a colour."}],
                 chat_template_kwargs={"enable_thinking": False})
    message = reply.choices[0].message
    assert message.content and "reasoning_content" not in (message.model_extra or {})


def test_bad_reasoning_options_are_refused(client):
    with pytest.raises(openai.BadRequestError, match="unknown reasoning format"):
        _ask(client, [{"role": "user", "content": "Hi"}], reasoning_format="sideways")
    with pytest.raises(openai.BadRequestError, match="messages cannot be set here"):
        _ask(client, [{"role": "user", "content": "Hi"}], chat_template_kwargs={"messages": []})


def test_ollama_clients_get_thinking_apart_too(server):
    client = ollama.Client(host=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=600)
    assert "thinking" in client.show(TARGET).capabilities
    reply = client.chat(model=TARGET, messages=[{"role": "user", "content": "Name a colour."}],
                        options={"temperature": 0, "num_predict": MAX_TOKENS})
    assert reply.message.thinking and not reply.message.content
    plain = client.chat(model=TARGET, messages=[{"role": "user", "content": "Name a colour."}], think=False,
                        options={"temperature": 0, "num_predict": MAX_TOKENS})
    assert plain.message.content and not plain.message.thinking
