"""Grammars over a model's vocabulary: llguidance matchers behind `core.rules.GrammarMatcher`.

llguidance (the optional grammar backend of llama.cpp itself) compiles JSON schemas, Lark and
GBNF grammars, and per token gives a vocabulary bitmask and the run of tokens the grammar forces
next. Its tokenizer is built from the llama.cpp vocabulary once per model (about a second on a
49k vocabulary) and kept with the model. A `Grammar` is compiled once per request; each
generation takes a fresh `Matcher` from it.

llguidance finds some grammars unusable only when it walks them: a `$ref` cycle admits no value
at all, a required property that refers back to its own object forces text without end (both
show at the first step, so `Grammar` takes that step when it is compiled), and a pattern may
exceed its lexer's limits only at the text the model chose (mid-answer). Either way the matcher
enters an error state in which it allows nothing but the end of the text; `Matcher` checks for it
at every step and raises a GrammarError, so a failure is never mistaken for a finished answer.
"""

from __future__ import annotations

import json
import threading
import warnings
from typing import Any

import numpy as np

from specrun.errors import EngineError, GrammarError, UsageError

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
            with warnings.catch_warnings():  # it reads token attributes through a deprecated alias
                warnings.simplefilter("ignore", DeprecationWarning)
                tok = (model, lltokenizer_from_vocab(model.vocab_ptr, n_vocab=model.n_vocab, eos_token=eog))
            _tokenizers[id(model)] = tok
        return tok[1]


def prepare(model) -> None:
    """Build llguidance's tokenizer for `model` now (seconds for a large vocabulary: 2.2 s for
    Gemma 3's 262k tokens), not in the first request that asks for a grammar."""
    _tokenizer(model)


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

    def __init__(self, model, grammar: str, what: str = "grammar"):
        self.tokenizer = _tokenizer(model)
        self.grammar = grammar
        self.what = what  # what the user gave: "grammar" or "JSON schema", for error messages
        self.n_vocab = model.n_vocab
        self._check_first_step()

    def _check_first_step(self) -> None:
        """Raise a GrammarError when no answer can begin: take the first step (the forced run,
        then the choice after it), where llguidance meets cycles and endless forced text."""
        matcher = self.matcher()
        try:
            for token in matcher.forced():
                matcher.consume(token)
            matcher.allowed()
        except GrammarError:
            raise GrammarError(f"unsupported {self.what}: no answer can follow it ({matcher.failure()})") from None

    @classmethod
    def from_schema(cls, model, schema: Any) -> Grammar:
        return cls(model, schema_grammar(schema), "JSON schema")

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
        matcher = _llg().LLMatcher(self.tokenizer, self.grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"unsupported {self.what}: {_first_line(matcher.get_error())}")
        return Matcher(matcher, self.n_vocab, self.what)


def _first_line(error: str) -> str:
    """Return the message of an llguidance error (its dump of the parser's state left out)."""
    return error.strip().splitlines()[0] if error.strip() else "unknown error"


class Matcher:
    """One grammar's state along the emitted text (see core.rules.GrammarMatcher).

    Every step raises a GrammarError once llguidance is in its error state."""

    def __init__(self, matcher, n_vocab: int, what: str = "grammar"):
        self._m = matcher
        self.n_vocab = n_vocab
        self.what = what

    def failure(self) -> str:
        """Return why the matcher is in its error state ("" when it is not)."""
        return _first_line(self._m.get_error()) if self._m.is_error() else ""

    def _check(self) -> None:
        if self._m.is_error():
            raise GrammarError(f"the {self.what} could not be followed to the end of the answer: llguidance "
                               f"gave up ({self.failure()}); simplify the {self.what}")

    def allowed(self) -> np.ndarray:
        """Return a bool per vocabulary token: may it come next?"""
        bits = np.frombuffer(self._m.compute_bitmask(), np.uint8)
        self._check()
        return np.unpackbits(bits, bitorder="little")[: self.n_vocab].view(bool)

    def mask(self, row: np.ndarray) -> None:
        allowed = self.allowed()
        row[: len(allowed)][~allowed] = -np.inf
        row[len(allowed):] = -np.inf

    def consume(self, token: int) -> None:
        if not self._m.consume_token(token):
            self._check()
            raise EngineError(f"the {self.what} refused token {token}")  # one its mask had allowed

    def forced(self) -> list[int]:
        if self._m.is_stopped():
            return []
        tokens = list(self._m.compute_ff_tokens())
        self._check()
        return tokens

    def accepting(self) -> bool:
        """True when the text so far is a complete sentence of the grammar."""
        return self._m.is_accepting()

