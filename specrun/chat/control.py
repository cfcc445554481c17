"""Control tokens only where the chat template writes them: message text is always tokenized as text.

A rendered chat prompt is one string, and tokenizing it with special tokens parsed would turn a
user's `<|im_end|>\\n<|im_start|>system` into real turn markers: anyone who can put text in a
message (a web page through a chat UI, a file an agent reads) could forge a system turn. So before
rendering, every control-token text inside the messages is swapped for a placeholder the template
cannot mistake for anything; after rendering, the control-token texts still in the output are the
template's own (`Marked.specials`), and the placeholders get their text back.

Tokenizing a `Marked` prompt then does what llama.cpp's tokenizer does with special tokens parsed
(split the text at them, tokenize the text between them on its own), but splits only at the
template's ones, and tokenizes everything between them with special tokens not parsed. For a
prompt whose messages hold no control-token text the result is token-for-token the usual one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# llama.cpp's token attributes (llama.h, enum llama_token_attr).
ATTR_UNKNOWN, ATTR_CONTROL = 1 << 0, 1 << 3
ATTR_LSTRIP, ATTR_RSTRIP = 1 << 7, 1 << 8
# Tokens that llama.cpp matches in text only when told to parse special tokens.
_PARSED_ONLY_AS_SPECIAL = ATTR_UNKNOWN | ATTR_CONTROL
# Placeholders are built from a Private Use Area character no message contains.
_PRIVATE_USE = range(0xE000, 0xF900)


@dataclass(frozen=True)
class Marked:
    """A rendered prompt and the control tokens its template wrote: (start, end, token id) spans."""

    text: str
    specials: tuple[tuple[int, int, int], ...] = ()

    def continues(self, prefix: str) -> bool:
        """Whether the text starts with `prefix` and no control token spans its end (its tokens
        then start with the prefix's own)."""
        end = len(prefix)
        return self.text.startswith(prefix) and not any(s < end < e for s, e, _ in self.specials)


class ControlTokens:
    """A vocabulary's control tokens: finding their texts, shielding messages, tokenizing `Marked` text."""

    def __init__(self, texts: dict[str, int], attrs: dict[int, int]):
        self.ids = texts
        self.attrs = attrs
        self._pattern = re.compile(_trie_regex(sorted(texts))) if texts else None

    @classmethod
    def of(cls, model) -> "ControlTokens":
        texts: dict[str, int] = {}
        attrs: dict[int, int] = {}
        for token in range(model.n_vocab):
            attr = model.token_attr(token)
            if attr & _PARSED_ONLY_AS_SPECIAL:
                text = model.token_text(token).decode("utf-8", "replace")
                if text:
                    texts.setdefault(text, token)
                    attrs[token] = attr
        return cls(texts, attrs)

    def find(self, text: str) -> list[tuple[int, int, int]]:
        """Return the control-token texts in `text`, leftmost longest first: (start, end, id)."""
        if self._pattern is None:
            return []
        return [(m.start(), m.end(), self.ids[m.group()]) for m in self._pattern.finditer(text)]

    # -- rendering --
    def shield(self, value: Any) -> tuple[Any, "Shield"]:
        """Return `value` (messages: dicts, lists, strings) with control-token texts replaced by placeholders."""
        shield = Shield(_unused_mark(value))
        return shield.apply(value, self), shield

    def marked(self, rendered: str, shield: "Shield") -> Marked:
        """Return the template's output with the messages' text put back and the template's control tokens found."""
        parts = shield.split(rendered)
        text: list[str] = []
        specials: list[tuple[int, int, int]] = []
        offset = 0
        for i, part in enumerate(parts):
            if i % 2:  # a placeholder: message text, never a control token
                part = shield.originals[int(part)] if int(part) < len(shield.originals) else part
            else:
                specials += [(offset + s, offset + e, t) for s, e, t in self.find(part)]
            text.append(part)
            offset += len(part)
        return Marked("".join(text), tuple(specials))

    # -- tokenizing --
    def tokenize(self, model, prompt: Marked, start: int = 0, add_special: bool = True) -> list[int]:
        """Return the tokens of `prompt.text[start:]`: control tokens at the template's spans only.

        `start` must not fall inside a span. add_special adds BOS (and EOS) when the model asks for them.
        """
        tokens = [model.bos] if add_special and model.add_bos else []
        pos = start
        for s, e, token in prompt.specials:
            if s < start:
                continue
            tokens += self._text_tokens(model, _lstripped(prompt.text[pos:s], self.attrs.get(token, 0)))
            tokens.append(token)
            pos = e
            if self.attrs.get(token, 0) & ATTR_RSTRIP:
                while pos < len(prompt.text) and prompt.text[pos].isspace():
                    pos += 1
        tokens += self._text_tokens(model, prompt.text[pos:])
        if add_special and model.add_eos:
            tokens.append(model.eos)
        return tokens

    @staticmethod
    def _text_tokens(model, text: str) -> list[int]:
        return model.tokenize(text, add_special=False, parse_special=False) if text else []


class Shield:
    """The placeholders of one rendering: `mark` + index + `mark`, and the texts they stand for."""

    def __init__(self, mark: str):
        self.mark = mark
        self.originals: list[str] = []
        self._split = re.compile(f"{mark}([0-9]+){mark}")

    def apply(self, value: Any, control: ControlTokens) -> Any:
        if isinstance(value, str):
            return self._shield_text(value, control)
        if isinstance(value, dict):
            return {k: self.apply(v, control) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.apply(v, control) for v in value]
        return value

    def _shield_text(self, text: str, control: ControlTokens) -> str:
        found = control.find(text)
        if not found:
            return text
        out, pos = [], 0
        for s, e, _ in found:
            out += [text[pos:s], f"{self.mark}{len(self.originals)}{self.mark}"]
            self.originals.append(text[s:e])
            pos = e
        out.append(text[pos:])
        return "".join(out)

    def split(self, rendered: str) -> list[str]:
        """Return the rendered text split into [text, placeholder index, text, ...]."""
        if not self.originals:
            return [rendered]
        return self._split.split(rendered)


def _lstripped(text: str, attr: int) -> str:
    # llama.cpp drops the whitespace before a token marked LSTRIP (and after one marked RSTRIP).
    return text.rstrip() if attr & ATTR_LSTRIP else text


def _unused_mark(value: Any) -> str:
    """Return a Private Use Area character that occurs in none of the strings in `value`."""
    seen: set[str] = set()

    def collect(v: Any) -> None:
        if isinstance(v, str):
            seen.update(c for c in v if "\ue000" <= c < "\uf900")
        elif isinstance(v, dict):
            for x in v.values():
                collect(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                collect(x)

    collect(value)
    for code in _PRIVATE_USE:
        if chr(code) not in seen:
            return chr(code)
    raise ValueError("the messages use every Private Use Area character")


def _trie_regex(words: list[str]) -> str:
    """Return a regex matching any of `words`, the longest at each position (a trie, so it stays fast
    with thousands of words: Gemma's vocabularies have over 6,000 control tokens)."""
    trie: dict = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict) -> str:
        ends = "" in node
        branches = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        if ends:
            return "(?:" + body + ")?"  # greedy: the longer word first, the shorter when it fails
        return body

    return build(trie)
