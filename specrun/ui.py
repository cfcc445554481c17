"""All terminal output in one place: model text raw to stdout, everything else to stderr.

Model text is written unstyled and flushed as it arrives, so `specrun generate > out.txt` holds
only the text. Progress, stats, warnings and errors go to stderr through a Rich console that
falls back to plain text when stderr is not a terminal or NO_COLOR is set.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console

_err: Console | None = None


def err_console() -> Console:
    """Return the stderr console (plain when NO_COLOR is set or stderr is not a terminal)."""
    global _err
    if _err is None or _err.file is not sys.stderr:
        no_color = bool(os.environ.get("NO_COLOR"))
        _err = Console(stderr=True, no_color=no_color, highlight=False, soft_wrap=True)
    return _err


def write_text(text: str) -> None:
    """Write model text to stdout as is, and flush so it streams."""
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def end_text(text_written: str) -> None:
    """End the model's output with a newline on a terminal, if it did not end with one."""
    if text_written and not text_written.endswith("\n") and sys.stdout.isatty():
        sys.stdout.write("\n")
        sys.stdout.flush()


def info(message: str) -> None:
    err_console().print(message, markup=False)


def dim(message: str) -> None:
    err_console().print(message, style="dim", markup=False)


def warn(message: str) -> None:
    err_console().print(f"warning: {message}", style="yellow", markup=False)


def error(message: str) -> None:
    err_console().print(f"error: {message}", style="bold red", markup=False)


def stats_line(stats: dict) -> str:
    """Return the one-line summary shown after an answer."""
    parts = [
        f"{stats['n_tokens']} tokens",
        f"{stats['tokens_per_s']:.1f} tok/s",
    ]
    if stats.get("n_passes"):
        parts.append(f"{stats['accepted_per_pass']:.2f} accepted/pass")
    if stats.get("n_prefilled") is not None:
        parts.append(f"prefill {stats['n_prefilled']} tokens in {stats['prefill_s']:.2f}s")
    return " · ".join(parts)
