"""One --jsonl request line -> a Request and its prompt, every field checked for type and range.

Errors name the JSON field (never a command-line flag), so a batch's caller can fix the line.
`null` for an optional field means "not given" (the command line's value, or the default).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

from specrun.errors import UsageError
from specrun.inputs import check_utf8, token_id
from specrun.runtime.request import Request

FIELDS = ("prompt", "messages", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "chat", "system", "parse_special",
          "presence_penalty", "frequency_penalty", "repeat_penalty", "logit_bias", "logprobs", "json_schema",
          "grammar", "reproducible", "id")


class FieldError(UsageError):
    """A request line's field has the wrong type or range."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _int_at_least(name: str, value, low: int) -> int:
    if not _is_int(value) or value < low:
        raise FieldError(name, f"{name} must be a whole number >= {low}, got {json.dumps(value)}")
    return value


def _number_in(name: str, value, low: float, high: float | None, low_open: bool = False) -> float:
    ok = _is_number(value) and (value > low if low_open else value >= low) and (high is None or value <= high)
    if not ok:
        left = f"> {low:g}" if low_open else f">= {low:g}"
        rule = f"{left} and <= {high:g}" if high is not None else left
        raise FieldError(name, f"{name} must be a number {rule}, got {json.dumps(value)}")
    return float(value)


def _text(name: str, value) -> str:
    if not isinstance(value, str):
        raise FieldError(name, f"{name} must be a string, got {json.dumps(value)}")
    try:
        return check_utf8(value, name)
    except UsageError as e:
        raise FieldError(name, str(e)) from None


def _stop(value) -> tuple[str, ...]:
    if isinstance(value, str):
        return (_text("stop", value),)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(_text("stop", s) for s in value)
    raise FieldError("stop", f"stop must be a string or a list of strings, got {json.dumps(value)}")


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise FieldError(name, f"{name} must be true or false, got {json.dumps(value)}")
    return value


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    if not isinstance(value, dict):
        raise FieldError("logit_bias", f"logit_bias must be an object of token id -> bias, got {json.dumps(value)}")
    out = []
    for key, bias in value.items():
        token = token_id(key)
        if token is None:
            raise FieldError("logit_bias", f"logit_bias keys must be token ids, got {json.dumps(key)}")
        out.append((token, _number_in("logit_bias", bias, -100.0, 100.0)))
    return tuple(out)


ROLES = ("system", "user", "assistant")


def _messages(value) -> tuple[tuple[str, str], ...]:
    """A conversation: a non-empty list of {"role", "content"} objects ending with a user's."""
    if not isinstance(value, list) or not value:
        raise FieldError("messages", f"messages must be a non-empty list of {{\"role\", \"content\"}} objects, got {json.dumps(value)[:80]}")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or set(message) - {"role", "content"}:
            raise FieldError("messages", f"{where} must be an object with \"role\" and \"content\" only, got {json.dumps(message)[:80]}")
        role = message.get("role")
        if role not in ROLES:
            raise FieldError("messages", f"{where}.role must be one of {', '.join(ROLES)}, got {json.dumps(role)}")
        content = message.get("content")
        if not isinstance(content, str):
            raise FieldError("messages", f"{where}.content must be a string, got {json.dumps(content)[:80]}")
        try:
            out.append((role, check_utf8(content, where + ".content")))
        except UsageError as e:
            raise FieldError("messages", str(e)) from None
    if out[-1][0] != "user":
        raise FieldError("messages", f"the last message must be the user's (the answer is the assistant's), got {out[-1][0]!r}")
    return tuple(out)


def _json_schema(value) -> str:
    if not isinstance(value, dict):
        raise FieldError("json_schema", f"json_schema must be a JSON object, got {json.dumps(value)}")
    return json.dumps(value)


_CHECKS = {
    "max_tokens": lambda v: _int_at_least("max_tokens", v, 1),
    "temperature": lambda v: _number_in("temperature", v, 0.0, None),
    "top_k": lambda v: _int_at_least("top_k", v, 0),
    "top_p": lambda v: _number_in("top_p", v, 0.0, 1.0, low_open=True),
    "min_p": lambda v: _number_in("min_p", v, 0.0, 1.0),
    "seed": lambda v: _int_at_least("seed", v, 0),
    "stop": _stop,
    "chat": lambda v: _flag("chat", v),
    "parse_special": lambda v: _flag("parse_special", v),
    "reproducible": lambda v: _flag("reproducible", v),
    "system": lambda v: _text("system", v),
    "presence_penalty": lambda v: _number_in("presence_penalty", v, -2.0, 2.0),
    "frequency_penalty": lambda v: _number_in("frequency_penalty", v, -2.0, 2.0),
    "repeat_penalty": lambda v: _number_in("repeat_penalty", v, 0.0, None, low_open=True),
    "logit_bias": _logit_bias,
    "logprobs": lambda v: _int_at_least("logprobs", v, 0),
    "json_schema": _json_schema,
    "messages": _messages,
    "grammar": lambda v: _text("grammar", v),
}


def parse_line(line: str, base: Request) -> tuple[Request, str | None, object]:
    """Return (request, prompt, id) for one JSON line (the prompt None where the line gives
    "messages": then the request carries them); raise UsageError (FieldError for a field)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise UsageError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise UsageError("not valid JSON (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise UsageError("each line must be a JSON object")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise FieldError(unknown[0], f"unknown field(s): {', '.join(unknown)} (known: {', '.join(FIELDS)})")
    prompt = None
    if obj.get("messages") is not None:
        if obj.get("prompt") is not None:
            raise FieldError("messages", 'give "prompt" or "messages", not both')
        for name in ("system", "chat"):
            if obj.get(name) is not None:
                raise FieldError(name, f'{name} goes with "prompt": "messages" are a chat (put a system message in them)')
    else:
        if "prompt" not in obj:
            raise FieldError("prompt", 'missing "prompt" (a non-empty string) or "messages"')
        prompt = _text("prompt", obj["prompt"])
        if not prompt.strip():
            raise FieldError("prompt", "prompt is empty")
    fields = {name: _CHECKS[name](value) for name, value in obj.items() if name in _CHECKS and value is not None}
    request = replace(base, **fields)
    if request.messages is not None:
        # A conversation is a chat; the command line's --system opens one that has no system message.
        messages = request.messages
        if request.system and all(role != "system" for role, _ in messages):
            messages = (("system", request.system), *messages)
        request = replace(request, messages=messages, chat=True, system=None)
    if request.system and request.chat is False:
        raise FieldError("system", 'system needs chat mode ("chat": true, or leave "chat" out)')
    if "json_schema" in fields and "grammar" in fields:
        raise FieldError("grammar", "give json_schema or grammar, not both")
    if "json_schema" in fields:  # a line's own constraint replaces the command line's
        request = replace(request, grammar=None)
    elif "grammar" in fields:
        request = replace(request, json_schema=None)
    try:
        request.check()
    except FieldError:
        raise
    except UsageError as e:
        field = next((f for f in ("json_schema", "grammar", "logprobs") if f in fields), None)
        if field is None:
            raise
        raise FieldError(field, str(e)) from None
    return request, prompt, obj.get("id")


def line_id(line: str):
    """Return the "id" of a request line that failed, if it has one, so results can be matched."""
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return obj.get("id") if isinstance(obj, dict) else None


def dumps(obj: dict) -> str:
    """Return one output line: UTF-8 JSON, with \\u escapes only where a value holds a lone surrogate."""
    text = json.dumps(obj, ensure_ascii=False)
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return json.dumps(obj)
