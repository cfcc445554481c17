"""Thinking text apart from the answer: the parser per syntax, fed whole and in every split, and
the real templates of reasoning models (from the pinned llama.cpp sources) it is chosen by."""

from __future__ import annotations

import pytest
from pinned_sources import template

from specrun.chat import reasoning, templates
from specrun.chat.reasoning import ReasoningParser, Split


def _run(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    splits = [parser.feed(p) for p in pieces] + [parser.finish()]
    return "".join(s.reasoning for s in splits), "".join(s.content for s in splits)


def _every_split(text: str) -> list[list[str]]:
    """Return the text cut in two at every position, and cut into single characters."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


CASES = [
    # (syntax, prompt opened <think>, generated text, reasoning, content)
    ("think", False, "<think>\nLet me add.\n</think>\n\nIt is 4.", "\nLet me add.\n", "It is 4."),
    ("think", True, "Let me add.</think>It is 4.", "Let me add.", "It is 4."),
    ("think", False, "It is 4, no <think> here.", "", "It is 4, no <think> here."),
    ("think", False, "\n<think>a < b</think>\nyes", "a < b", "yes"),
    ("think", True, "unfinished thoughts </thi", "unfinished thoughts </thi", ""),
    ("harmony", False, "<|channel|>analysis<|message|>User asks 2+2.<|end|><|start|>assistant"
                       "<|channel|>final<|message|>4<|return|>", "User asks 2+2.", "4"),
    # <|end|> is a control token: plain detokenization drops it, and <|start|> ends the message.
    ("harmony", False, "<|channel|>analysis<|message|>Think.<|start|>assistant<|channel|>final<|message|>Done.",
     "Think.", "Done."),
    ("harmony", False, "Plain answer without channels.", "", "Plain answer without channels."),
    ("harmony", False, "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>", "", "{}"),
]


@pytest.mark.parametrize("syntax,opened,text,want_reasoning,want_content", CASES)
def test_parser_splits_the_same_however_the_text_arrives(syntax, opened, text, want_reasoning, want_content):
    for pieces in _every_split(text):
        got = _run(ReasoningParser(syntax, in_reasoning=opened), pieces)
        assert got == (want_reasoning, want_content), pieces


def test_a_split_marker_is_held_back_until_decided():
    parser = ReasoningParser("think", in_reasoning=True)
    assert parser.feed("step one </th") == Split(reasoning="step one ")  # "</th" may end the thoughts
    assert parser.feed("ink>\n\nAnswer") == Split(content="Answer")


@pytest.mark.parametrize("name,syntax,opens", [
    ("Qwen3.5-4B", "think", True),
    ("Qwen-Qwen3-0.6B", "think", False),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "think", True),
    ("openai-gpt-oss-120b", "harmony", False),
])
def test_real_templates_choose_their_syntax(name, syntax, opens):
    source = template(name)
    assert reasoning.template_syntax(source) == syntax
    messages = [{"role": "user", "content": "What is 2+2?"}]
    variables = {"enable_thinking": True} if "DeepSeek" in name else {}
    prompt = templates.render_chat(source, messages, True, **variables)
    assert reasoning.opens_thinking(prompt) == opens


def test_enable_thinking_false_closes_the_thoughts_in_the_prompt():
    prompt = templates.render_chat(template("Qwen3.5-4B"), [{"role": "user", "content": "Hi"}], True,
                                   enable_thinking=False)
    assert prompt.endswith("<think>\n\n</think>\n\n") and not reasoning.opens_thinking(prompt)


def test_plain_templates_have_no_reasoning_syntax():
    assert reasoning.template_syntax(templates.CHATML_TEMPLATE) is None
    assert reasoning.template_syntax(None) is None


@pytest.mark.parametrize("name,want", [("auto", "auto"), ("NONE", "none"), ("deepseek", "auto")])
def test_format_names(name, want):
    assert reasoning.normalize_format(name) == want


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown reasoning format"):
        reasoning.normalize_format("sideways")


def test_chat_shows_thinking_dimmed_on_stderr_and_the_answer_on_stdout(offline_models, cli, tmp_path):
    """`specrun chat` with Qwen3.5's template (it opens <think>): the demo model's text is all
    thinking, so stdout stays empty; with --reasoning-format none the same text is the answer."""
    path = tmp_path / "qwen35.jinja"
    path.write_text(template("Qwen3.5-4B"))
    args = ["chat", "--target", "smollm2-135m-f32", "--no-spec", "--threads", "1", "--ctx-size", "512", "-n", "8",
            "--chat-template", str(path)]
    apart = cli(*args, input="What is 2+2?\n")
    whole = cli(*args, "--reasoning-format", "none", input="What is 2+2?\n")
    assert apart.exit_code == 0 and whole.exit_code == 0, apart.output + whole.output
    answer = whole.stdout.strip()
    assert answer and apart.stdout == ""
    assert answer in apart.stderr
    bad = cli(*args, "--reasoning-format", "sideways", input="hi\n")
    assert bad.exit_code == 2 and "--reasoning-format" in bad.output


def test_template_variables_are_text_like_the_messages(offline_models):
    """chat_template_kwargs come from a request: control-token text in them must stay text."""
    from specrun import engine
    from specrun.chat.session import ChatFormat

    with engine.Model(offline_models.smollm2_q4, vocab_only=True) as model:
        fmt = ChatFormat(model)
        fmt.template = "<|im_start|>{{ messages[0]['content'] }}{{ note }}"
        rendered = fmt.render([{"role": "user", "content": "hi"}], note="<|im_end|>")
    assert rendered.text == "<|im_start|>hi<|im_end|>"
    assert [rendered.text[s:e] for s, e, _ in rendered.specials] == ["<|im_start|>"]
