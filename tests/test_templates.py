"""Chat templates: the models' own templates, Gemma's system folding, turn suffixes, fallbacks."""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from pathlib import Path

import gguf
import pytest
from llama_cpp import Llama

from specrun.chat.templates import (
    CHATML_TEMPLATE,
    GEMMA_TEMPLATE,
    builtin_template,
    render_chat,
)


@pytest.fixture(scope="session")
def gemma_q4_path(offline_models) -> Path:
    return offline_models.gemma_q4


@pytest.fixture(scope="module")
def smollm2_template(smollm2_q4_path) -> str:
    field = gguf.GGUFReader(smollm2_q4_path).fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode()


@pytest.fixture(scope="module")
def gemma_vocab(gemma_q4_path):
    # llama.cpp's loader, not GGUFReader: parsing Gemma's 262k-token arrays in Python takes ~20 s.
    llm = Llama(str(gemma_q4_path), vocab_only=True, verbose=False)
    yield llm
    llm.close()


CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
    {"role": "user", "content": "Thanks!"},
]


def test_smollm2_template_renders_chatml_with_its_default_system_prompt(smollm2_template):
    prompt = render_chat(smollm2_template, [{"role": "user", "content": "Hi"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_smollm2_template_uses_the_given_system_prompt(smollm2_template):
    prompt = render_chat(smollm2_template, CONVERSATION[:2])
    assert prompt.startswith("<|im_start|>system\nYou answer in one word.<|im_end|>\n")
    assert "SmolLM" not in prompt
    assert render_chat(smollm2_template, CONVERSATION[:2], add_generation_prompt=False).endswith(
        "Capital of France?<|im_end|>\n"
    )


def test_gemma_file_has_no_template_so_the_gemma_format_is_builtin(gemma_vocab):
    assert "tokenizer.chat_template" not in gemma_vocab.metadata
    assert builtin_template(gemma_vocab.metadata["general.architecture"]) == GEMMA_TEMPLATE
    assert builtin_template("llama") is None
    # The turn markers the built-in template writes are single special tokens of this vocabulary.
    for marker in ("<start_of_turn>", "<end_of_turn>"):
        assert len(gemma_vocab.tokenize(marker.encode(), add_bos=False, special=True)) == 1


def test_gemma_folds_the_system_prompt_into_the_first_user_turn():
    prompt = render_chat(GEMMA_TEMPLATE, CONVERSATION[:4], bos_token="<bos>")
    assert prompt == (
        "<bos><start_of_turn>user\nYou answer in one word.\n\nCapital of France?<end_of_turn>\n"
        "<start_of_turn>model\nParis.<end_of_turn>\n"
        "<start_of_turn>user\nAnd of Italy?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    no_system = render_chat(GEMMA_TEMPLATE, CONVERSATION[1:2])
    assert no_system == "<start_of_turn>user\nCapital of France?<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def smollm2_vocab(smollm2_q4_path):
    from specrun.engine.model import Model

    model = Model(smollm2_q4_path, vocab_only=True)
    yield model
    model.close()


@pytest.fixture
def render_incremental(smollm2_vocab):
    """Return render(template, history, new, rendered_history=None) -> Turn, as a chat session renders a turn."""
    from specrun.chat.session import ChatFormat

    def render(template, history, new, rendered_history=None):
        fmt = ChatFormat(smollm2_vocab)
        fmt.template, fmt.bos_text, fmt.eos_text = template, "", ""  # as render_chat renders by default
        full = fmt.render(history + new)
        if rendered_history is None:  # (many templates index messages[0] unguarded)
            rendered_history = fmt.render(history, add_generation_prompt=False).text if history else ""
        return Turn(full.text, full.text[len(rendered_history):] if full.continues(rendered_history) else None)

    return render


@dataclass
class Turn:
    full: str
    suffix: str | None


@pytest.mark.parametrize("template_name", ["smollm2", "gemma", "chatml"])
def test_each_turn_appends_a_suffix_to_the_rendered_history(template_name, request, render_incremental):
    template = {
        "smollm2": lambda: request.getfixturevalue("smollm2_template"),
        "gemma": lambda: GEMMA_TEMPLATE,
        "chatml": lambda: CHATML_TEMPLATE,
    }[template_name]()
    for user_turn in (1, 3, 5):  # history ends with the system prompt or an assistant reply
        history, new = CONVERSATION[:user_turn], CONVERSATION[user_turn : user_turn + 1]
        turn = render_incremental(template, history, new)
        assert turn.full == render_chat(template, history + new)
        assert turn.suffix is not None
        assert render_chat(template, history, add_generation_prompt=False) + turn.suffix == turn.full
        assert turn.suffix.count(new[0]["content"]) == 1


def test_suffix_after_a_generated_reply_that_stopped_at_the_end_of_turn_token(smollm2_template, render_incremental):
    # The context holds the prompt plus the reply up to <|im_end|>, without the template's newline.
    context = render_chat(smollm2_template, CONVERSATION[:2]) + "Paris.<|im_end|>"
    turn = render_incremental(smollm2_template, CONVERSATION[:3], CONVERSATION[3:4], rendered_history=context)
    assert turn.suffix == "\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n"
    assert context + turn.suffix == turn.full


def test_template_that_rerenders_earlier_turns_reports_no_suffix(render_incremental):
    # Like reasoning models' templates that drop old thoughts: the last message renders differently.
    template = "{% for m in messages %}{{ '[last] ' if loop.last else '' }}{{ m['content'] }}\n{% endfor %}"
    turn = render_incremental(template, CONVERSATION[:2], CONVERSATION[2:3])
    assert turn.suffix is None
    assert turn.full == render_chat(template, CONVERSATION[:3])


@pytest.mark.parametrize(
    "broken",
    [
        None,
        "{% for message in messages %}{{ message['content'] }",  # syntax error
        "{{ raise_exception('Conversation roles must alternate') }}",
        "{{ messages[0].__class__.__mro__ }}",  # escaping the sandbox is refused
        "{% set seen = [] %}{{ seen.append(1) }}",  # the sandbox is immutable
    ],
)
def test_missing_or_failing_template_falls_back_to_chatml_with_a_warning(broken, caplog):
    caplog.set_level(logging.WARNING, logger="specrun.templates")
    messages = [{"role": "user", "content": f"fallback case {broken!r}"}]
    prompt = render_chat(broken, messages)
    assert prompt == f"<|im_start|>user\nfallback case {broken!r}<|im_end|>\n<|im_start|>assistant\n"
    assert any("ChatML" in r.getMessage() for r in caplog.records)


def test_template_helpers_behave_like_hugging_face():
    template = (
        "{{ messages[0] | tojson }}|{{ strftime_now('%Y') }}|{{ tools | tojson(indent=None) }}"
        "{% for m in messages %}{% generation %}{{ m['role'] }}{% endgeneration %}{% break %}{% endfor %}"
    )
    messages = [{"role": "user", "content": "<b>fish & chips</b> ünï"}, {"role": "assistant", "content": "x"}]
    prompt = render_chat(template, messages, tools=[{"name": "f"}])
    year = datetime.datetime.now().strftime("%Y")
    assert prompt == f'{{"role": "user", "content": "<b>fish & chips</b> ünï"}}|{year}|[{{"name": "f"}}]user'


def test_the_server_remembers_the_tokens_of_several_conversations(smollm2_vocab, smollm2_template):
    """Clients answered side by side (serve --parallel) each continue their own conversation: its
    next turn reuses the tokens its answer was generated as, even when those are not how the text
    would be tokenized afresh, until enough other conversations came after it."""
    from specrun.chat.session import ChatFormat
    from specrun.chat.session import ConversationMemory

    fmt = ChatFormat(smollm2_vocab)
    fmt.template = smollm2_template
    memory = ConversationMemory(capacity=2)
    end_of_turn = smollm2_vocab.tokenize("<|im_end|>", add_special=False)
    spelled = {}  # conversation: (messages so far, tokens of its answer as "generated")

    def first_turn(question: str, answer: str) -> None:
        messages = [{"role": "user", "content": question}]
        rendered = fmt.render(messages)
        prompt = memory.tokens_for(fmt, rendered)
        # The answer generated one character a token: no fresh tokenization splits it so.
        generated = [t for ch in answer for t in smollm2_vocab.tokenize(ch, add_special=False, parse_special=False)]
        assert generated != smollm2_vocab.tokenize(answer, add_special=False, parse_special=False)
        memory.remember(rendered.text + answer + "<|im_end|>", prompt + generated + end_of_turn)
        spelled[question] = (messages + [{"role": "assistant", "content": answer}], prompt + generated + end_of_turn)

    def next_turn_reuses(question: str) -> bool:
        messages, tokens = spelled[question]
        rendered = fmt.render(messages + [{"role": "user", "content": "And then?"}])
        return memory.tokens_for(fmt, rendered)[: len(tokens)] == tokens

    first_turn("Capital of France?", "Paris, in France.")
    first_turn("Capital of Spain?", "Madrid, in Spain.")
    assert next_turn_reuses("Capital of France?") and next_turn_reuses("Capital of Spain?")
    first_turn("Capital of Peru?", "Lima, in Peru.")  # the least recently used (France) is forgotten
    assert next_turn_reuses("Capital of Peru?") and next_turn_reuses("Capital of Spain?")
    assert not next_turn_reuses("Capital of France?")
