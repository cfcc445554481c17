"""Text a user gives specrun (argument, stdin, --file, chat line, JSONL line): UTF-8, or one clear error.

One rule everywhere: text that is not valid UTF-8 is refused with a message that says where the
bad bytes are ("stdin is not UTF-8 text (invalid byte 0xff at offset 0)"), never guessed at or
silently replaced. Python hands undecodable command-line bytes over as lone surrogates
(surrogateescape); those are traced back to the byte they stand for.
"""

from __future__ import annotations

import sys

from specrun.errors import UsageError


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
