"""Grammars over a model's vocabulary: llguidance matchers behind `core.rules.GrammarMatcher`.

llguidance (the optional grammar backend of llama.cpp itself) compiles JSON schemas, Lark and
GBNF grammars, and per token gives a vocabulary bitmask and the run of tokens the grammar forces
next. Its tokenizer is built from the llama.cpp vocabulary once per model (about a second on a
49k vocabulary) and kept with the model. A `Grammar` is compiled once per request; each
generation takes a fresh `Matcher` from it.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np

from specrun.errors import EngineError, UsageError

# The JSON layout a schema's grammar forces: the compact separators most models were trained on
# (llama.cpp's converter writes them too), no free whitespace between tokens, so that keys,
# braces and separators are forced runs (free drafts) rather than choices.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}

_tokenizers: dict[int, Any] = {}
_tokenizers_lock = threading.Lock()


def _llg():
    try:
        import llguidance
    except ImportError as e:  # a dependency of specrun: only a broken install lacks it
        raise EngineError(f"grammars need the llguidance package ({e})") from None
    return llguidance


def _tokenizer(model):
    """Return llguidance's tokenizer for `model`'s vocabulary (built once per model)."""
    with _tokenizers_lock:
        tok = _tokenizers.get(id(model))
        if tok is None or tok[0] is not model:
            from llguidance.llamacpp import lltokenizer_from_vocab

            # Every end-of-generation token ends a grammar's text (chat models end turns with theirs).
            eog = sorted(model.eog_tokens) or [model.eos]
            tok = (model, lltokenizer_from_vocab(model.vocab_ptr, n_vocab=model.n_vocab, eos_token=eog))
            _tokenizers[id(model)] = tok
        return tok[1]


def schema_grammar(schema: Any) -> str:
    """Return llguidance's grammar for a JSON schema (a dict, or True for any JSON object)."""
    llg = _llg()
    if schema is True:
        schema = {"type": "object"}
    if not isinstance(schema, dict):
        raise UsageError("a JSON schema must be a JSON object")
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except ValueError as e:
        raise UsageError(f"invalid JSON schema: {e}") from None
    return _checked(grammar, "JSON schema")


def text_grammar(text: str) -> str:
    """Return llguidance's grammar for a GBNF (llama.cpp) or Lark grammar text."""
    llg = _llg()
    try:
        grammar = llg.grammar_from("gbnf", text)  # accepts Lark as well
    except ValueError as e:
        raise UsageError(f"invalid grammar: {e}") from None
    return _checked(grammar, "grammar")


def _checked(grammar: str, what: str) -> str:
    """Return the grammar, or raise a UsageError saying what llguidance cannot compile in it."""
    is_error, messages = _llg().LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        first = messages[0].strip().splitlines()[0] if messages else "unknown error"
        raise UsageError(f"unsupported {what}: {first}")
    return grammar


class Grammar:
    """A compiled grammar for one model; `matcher()` starts it at the beginning of the output."""

    def __init__(self, model, grammar: str):
        self.tokenizer = _tokenizer(model)
        self.grammar = grammar
        self.n_vocab = model.n_vocab
        self.matcher().close_check()  # compile errors surface here, once

    @classmethod
    def from_schema(cls, model, schema: Any) -> Grammar:
        return cls(model, schema_grammar(schema))

    @classmethod
    def from_text(cls, model, text: str) -> Grammar:
        return cls(model, text_grammar(text))

    @classmethod
    def from_lark(cls, model, lark: str) -> Grammar:
        return cls(model, _checked(_llg().LLMatcher.grammar_from_lark(lark), "grammar"))

    @staticmethod
    def literal(model, text: str) -> str:
        """Return `text` as a Lark literal: the special token it is in `model`'s vocabulary, if it
        is one (templates write markers such as <tool_call> as single special tokens), else a string."""
        tokens = model.tokenize(text, add_special=False, parse_special=True)
        if len(tokens) == 1 and _tokenizer(model).is_special_token(tokens[0]):
            return f"<[{tokens[0]}]>"
        return json.dumps(text, ensure_ascii=False)

    def matcher(self) -> Matcher:
        return Matcher(_llg().LLMatcher(self.tokenizer, self.grammar, log_level=0), self.n_vocab)


class Matcher:
    """One grammar's state along the emitted text (see core.rules.GrammarMatcher)."""

    def __init__(self, matcher, n_vocab: int):
        self._m = matcher
        self.n_vocab = n_vocab

    def close_check(self) -> None:
        if self._m.is_error():
            raise UsageError(f"the grammar does not compile: {self._m.get_error()}")

    def allowed(self) -> np.ndarray:
        """Return a bool per vocabulary token: may it come next?"""
        bits = np.frombuffer(self._m.compute_bitmask(), np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.n_vocab].view(bool)

    def mask(self, row: np.ndarray) -> None:
        allowed = self.allowed()
        row[: len(allowed)][~allowed] = -np.inf
        row[len(allowed):] = -np.inf

    def consume(self, token: int) -> None:
        if not self._m.consume_token(token):
            raise EngineError(f"the grammar refused token {token}: {self._m.get_error()}")

    def forced(self) -> list[int]:
        if self._m.is_stopped():
            return []
        return list(self._m.compute_ff_tokens())

    def done(self) -> bool:
        """True once the grammar's text is complete and nothing more may follow."""
        return self._m.is_stopped()

