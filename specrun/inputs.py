"""Text a user gives specrun (argument, stdin, --file, chat line, JSONL line): UTF-8, or one clear error.

One rule everywhere: text that is not valid UTF-8 is refused with a message that says where the
bad bytes are ("stdin is not UTF-8 text (invalid byte 0xff at offset 0)"), never guessed at or
silently replaced. Python hands undecodable command-line bytes over as lone surrogates
(surrogateescape); those are traced back to the byte they stand for.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specrun.errors import UsageError


def token_id(key: str) -> int | None:
    """Return the token id a JSON object key spells (ASCII digits: "²" is a digit to Python, but
    no number), or None."""
    return int(key) if key.isascii() and key.isdigit() else None


def decode_utf8(data: bytes, where: str) -> str:
    """Return data decoded as UTF-8; raise UsageError naming `where` and the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{where} is not UTF-8 text (invalid byte 0x{data[e.start]:02x} at offset {e.start})") from None


def check_utf8(text: str, where: str) -> str:
    """Return text if it can be written as UTF-8; raise UsageError for lone surrogates."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError as e:
        bad = e.start
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise UsageError(f"{where} contains a lone surrogate (U+{ord(text[bad]):04X} at character {bad}), "
                         "which is not text") from None
    decode_utf8(raw, where)
    return text  # not reached: the escaped bytes were invalid UTF-8


def read_stdin(where: str = "stdin") -> str:
    """Return all of stdin as text (read as bytes, so invalid UTF-8 gets a clear error)."""
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:  # a text-only stream (tests, embedding): already decoded
        return check_utf8(sys.stdin.read(), where)
    return decode_utf8(buffer.read(), where)


def read_text_file(path: Path, what: str) -> str:
    """Return a UTF-8 text file's contents, or raise a one-line error naming `what` it is."""
    try:
        return decode_utf8(path.read_bytes(), f"{what} {path}")
    except IsADirectoryError:
        raise UsageError(f"{what} {path} is a directory") from None
    except OSError as e:
        raise UsageError(f"cannot read {what} {path}: {e.strerror}") from None


def option_file(path: Path | None, option: str) -> str | None:
    """Return the UTF-8 text of an option's file (None when not given), or a one-line error."""
    return None if path is None else read_text_file(path, f"{option} file")


def json_schema_file(path: Path | None) -> str | None:
    """Return the JSON text of a --json-schema file (checked to be a JSON object), or None."""
    text = option_file(path, "--json-schema")
    if text is None:
        return None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--json-schema file {path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(schema, dict):
        raise UsageError(f"--json-schema file {path} must hold a JSON object")
    return json.dumps(schema)


def read_prompt(prompt: str | None, file: Path | None) -> str:
    """Return the one prompt of `specrun generate`: the argument, --file, or stdin ("-" or piped)."""
    if prompt is not None and file is not None:
        raise UsageError("give the prompt either as an argument or with --file, not both")
    if file is not None:
        return read_text_file(file, "prompt file")
    if prompt == "-" or (prompt is None and not sys.stdin.isatty()):
        return read_stdin()
    if prompt is not None:
        return check_utf8(prompt, "the prompt argument")
    raise UsageError("no prompt: pass it as an argument, with --file, or on stdin")
