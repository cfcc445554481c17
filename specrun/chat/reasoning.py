"""Thinking text apart from the answer: `<think>...</think>` and gpt-oss's harmony analysis channel.

Reasoning models write their thinking before the answer. Clients (Open WebUI, the OpenAI API's
`reasoning_content` convention of DeepSeek, llama.cpp's and vLLM's servers) expect it in a field of
its own, so the text a model generates is split as it streams:

- `think`: Qwen3/3.5, DeepSeek-R1 and its distills, QwQ... write `<think>thoughts</think>answer`.
  Many templates open `<think>` in the generation prompt themselves (`opens_thinking`), so the
  generated text starts inside the thoughts and only `</think>` follows.
- `harmony` (gpt-oss): `<|channel|>analysis<|message|>thoughts<|end|><|start|>assistant
  <|channel|>final<|message|>answer<|return|>`. Channels other than analysis count as the answer.

Markers can arrive split over several pieces of streamed text: a piece's tail that could still
begin a marker is held back until the next piece decides it.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CHANNEL, MESSAGE, START = "<|channel|>", "<|message|>", "<|start|>"
# What ends a harmony message's body. <|end|> is a control token that plain detokenization drops,
# so the next message's <|start|> also ends it.
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>", START)
# Harmony channels whose text is thinking rather than the answer.
THINKING_CHANNELS = ("analysis",)

FORMATS = ("auto", "none")  # --reasoning-format / per request reasoning_format
# Other servers' names for "split it out" (llama.cpp: deepseek, deepseek-legacy; vLLM: parsers).
FORMAT_ALIASES = {"deepseek": "auto", "deepseek-legacy": "auto", "parsed": "auto"}


def normalize_format(name: str) -> str:
    """Return "auto" or "none" for a reasoning format name, or raise ValueError."""
    name = name.strip().lower()
    name = FORMAT_ALIASES.get(name, name)
    if name not in FORMATS:
        raise ValueError(f"unknown reasoning format {name!r}: use auto (thinking in reasoning_content) "
                         "or none (thinking left in content)")
    return name


def template_syntax(template: str | None) -> str | None:
    """Return the reasoning syntax a chat template's model writes: "harmony", "think" or None."""
    if not template:
        return None
    if "<|channel|>" in template and "<|message|>" in template:
        return "harmony"
    if THINK_CLOSE in template:
        return "think"
    return None


@dataclass(frozen=True)
class ChatSettings:
    """What a front end (server, terminal chat) does with chats: where thinking goes (auto: apart,
    none: left in the answer), and a chat template replacing the model's (--chat-template)."""

    reasoning_format: str = "auto"
    template: str | None = None


def parser_for(template: str | None, rendered_prompt: str, reasoning_format: str = "auto") -> "ReasoningParser | None":
    """Return the parser that splits the thinking out of answers to this prompt, or None to leave
    them whole (reasoning format "none", or a template whose model does not think)."""
    syntax = template_syntax(template)
    if syntax is None or reasoning_format == "none":
        return None
    return ReasoningParser(syntax, in_reasoning=syntax == "think" and opens_thinking(rendered_prompt))


def opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an opened `<think>` (the answer starts with thoughts)."""
    return prompt.rstrip().endswith(THINK_OPEN)


@dataclass(frozen=True)
class Split:
    """A piece of generated text, divided into thinking and answer."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Return how many trailing characters of text could still begin one of the markers."""
    for k in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


class ReasoningParser:
    """Splits streamed text into thinking and answer; `feed` each piece, then `finish` once."""

    def __init__(self, syntax: str, in_reasoning: bool = False):
        if syntax not in ("think", "harmony"):
            raise ValueError(f"unknown reasoning syntax {syntax!r}")
        self.syntax = syntax
        self._buffer = ""
        if syntax == "think":
            self._state = "reasoning" if in_reasoning else "start"
        else:
            self._state = "header"
            self._channel = ""

    def feed(self, text: str) -> Split:
        """Return the thinking and answer text that this piece completes."""
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> Split:
        """Return what was held back (an unfinished marker is text after all)."""
        return self._drain(final=True)

    # -- one state machine per syntax; each step consumes a prefix of the buffer --
    def _drain(self, final: bool) -> Split:
        reasoning: list[str] = []
        content: list[str] = []
        step = self._think_step if self.syntax == "think" else self._harmony_step
        while self._buffer:
            if not step(reasoning, content, final):
                break
        return Split("".join(reasoning), "".join(content))

    def _think_step(self, reasoning: list[str], content: list[str], final: bool) -> bool:
        buf = self._buffer
        if self._state == "start":
            # Thinking only counts when the answer opens with <think> (leading blank lines aside).
            stripped = buf.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._buffer, self._state = stripped[len(THINK_OPEN):], "reasoning"
                return True
            if THINK_OPEN.startswith(stripped) and not final:
                return False  # could still become <think>
            self._state = "content"
            return True
        if self._state in ("content", "answer"):
            if self._state == "answer":
                buf = buf.lstrip("\n")  # blank lines after </think> may arrive in a later piece
                self._state = "answer" if not buf else "content"
            content.append(buf)
            self._buffer = ""
            return False
        # inside the thoughts, up to </think>
        end = buf.find(THINK_CLOSE)
        if end >= 0:
            reasoning.append(buf[:end])
            # The answer starts after the blank lines that follow </think>.
            self._buffer, self._state = buf[end + len(THINK_CLOSE):].lstrip("\n"), "answer"
            return True
        hold = 0 if final else _held(buf, (THINK_CLOSE,))
        reasoning.append(buf[: len(buf) - hold])
        self._buffer = buf[len(buf) - hold:]
        return False

    def _harmony_step(self, reasoning: list[str], content: list[str], final: bool) -> bool:
        buf = self._buffer
        if self._state == "header":
            # <|start|>assistant<|channel|>NAME [to=...] [<|constrain|>...]<|message|>
            at = buf.find(MESSAGE)
            if at >= 0:
                header = buf[:at]
                name = header.split(CHANNEL, 1)[1] if CHANNEL in header else ""
                self._channel = name.split()[0].split("<|")[0] if name.split() else ""
                self._buffer, self._state = buf[at + len(MESSAGE):], "body"
                return True
            stripped = buf.lstrip()
            if not final and (any(m.startswith(stripped) for m in (CHANNEL, START))
                              or stripped.startswith((CHANNEL, START))):
                return False  # a header on its way
            # Not harmony after all: the model answered in plain text.
            self._channel, self._state = "final", "body"
            return True
        sink = reasoning if self._channel in THINKING_CHANNELS else content
        ends = [(i, m) for m in HARMONY_ENDS if (i := buf.find(m)) >= 0]
        if ends:
            at, marker = min(ends)
            sink.append(buf[:at])
            # <|start|> opens the next header; the other markers are dropped.
            self._buffer = buf[at:] if marker == START else buf[at + len(marker):]
            self._state = "header"
            return True
        hold = 0 if final else _held(buf, HARMONY_ENDS)
        sink.append(buf[: len(buf) - hold])
        self._buffer = buf[len(buf) - hold:]
        return False
