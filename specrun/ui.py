"""All terminal output in one place: model text raw to stdout, everything else to stderr.

Model text is written unstyled and flushed as it arrives, so `specrun generate > out.txt` holds
only the text. Progress, stats, warnings and errors go to stderr through a Rich console that
falls back to plain text when stderr is not a terminal or NO_COLOR is set.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from collections.abc import Iterator

from rich.console import Console
from rich.errors import LiveError

from specrun.errors import UsageError
from specrun.files import human_size
from specrun.inputs import check_utf8, decode_utf8

_err: Console | None = None
_err_key: tuple = ()


def _no_color() -> bool:
    # https://no-color.org: set and not empty.
    return bool(os.environ.get("NO_COLOR"))


def err_console() -> Console:
    """Return the stderr console: plain text (no escape codes) when NO_COLOR is set or stderr is
    not a terminal."""
    global _err, _err_key
    key = (sys.stderr, _no_color(), os.environ.get("FORCE_COLOR"), os.environ.get("TERM"))
    if _err is None or key != _err_key:
        color = None if _no_color() else "auto"
        _err = _StderrConsole(file=sys.stderr, color_system=color, highlight=False, soft_wrap=True)
        _err_key = key
    return _err


class _StderrConsole(Console):
    """The stderr console, which goes quiet when stderr breaks instead of ending the program.

    Rich's default answer to a broken pipe is to point stdout at /dev/null and raise SystemExit:
    in `specrun serve | grep -m1 listening` that would kill the generation worker, and in
    `specrun generate 2>&1 | head` it would lose model text. Messages are extras; the work goes on."""

    def on_broken_pipe(self) -> None:
        self.quiet = True


def _say(message: str, style: str | None = None) -> None:
    console = err_console()
    try:
        console.print(message, style=style, markup=False)
    except OSError:  # stderr closed or gone (EIO from a vanished terminal): stop writing to it
        console.quiet = True


def write_text(text: str) -> None:
    """Write model text to stdout as is, and flush so it streams."""
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def end_text(text_written: str) -> None:
    """End the model's output with a newline if it did not end with one (a shell prompt or the
    next line of a pipeline then starts on a line of its own, as with `llm` and `ollama run`)."""
    if text_written and not text_written.endswith("\n"):
        sys.stdout.write("\n")
        sys.stdout.flush()


def out_console() -> Console:
    """Return a console on stdout for a command's own output (tables); plain when piped."""
    # A pipe has no width: don't squeeze or wrap table rows to 80 columns.
    width = None if sys.stdout.isatty() else 10_000
    return Console(file=sys.stdout, color_system=None if _no_color() else "auto", highlight=False, soft_wrap=True, width=width)


def setup_logging(verbose: bool) -> None:
    """Send log records to stderr: everything with `verbose`, else warnings and worse."""
    level = logging.DEBUG if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(name)s: %(message)s", stream=sys.stderr, force=True)
    # llama.cpp's own chatter stays silent unless asked for.
    logging.getLogger("specrun.llama").setLevel(logging.INFO if verbose else logging.CRITICAL)


def info(message: str) -> None:
    _say(message)


def dim(message: str) -> None:
    _say(message, style="dim")


@contextlib.contextmanager
def waiting(text: str) -> Iterator[None]:
    """A transient line on a terminal's stderr while a pause of seconds lasts (a spinner, gone
    after); nothing where stderr is not a terminal, or where another live display holds it."""
    try:
        status = err_console().status(text)
        status.start()
    except LiveError:
        yield
        return
    try:
        yield
    finally:
        status.stop()


def thinking(text: str) -> None:
    """Write a piece of a reasoning model's thinking on stderr, dimmed, without a line break."""
    console = err_console()
    console.print(text, style="dim italic", markup=False, highlight=False, end="")
    console.file.flush()


def warn(message: str) -> None:
    _say(f"warning: {message}", style="yellow")


def error(message: str) -> None:
    _say(f"error: {message}", style="bold red")


def stats_line(stats: dict, prefill: bool = True) -> str:
    """Return the one-line summary shown after an answer."""
    parts = [f"{stats['n_tokens']} tokens"]
    if stats.get("tokens_per_s") is not None:  # (none for one token: no decoding pass to time)
        parts.append(f"{stats['tokens_per_s']:.1f} tok/s")
    if stats.get("n_passes"):
        parts.append(f"{stats['accepted_per_pass']:.2f} accepted/pass")
    if stats.get("lookup_tokens"):
        parts.append(f"drafts accepted: {stats['lookup_tokens']} from lookup, {stats.get('draft_tokens', 0)} from the draft model")
    if stats.get("near_ties"):  # (docs/exactness.md; --verbose names them)
        parts.append(f"{stats['near_ties']} near-tie{'s' if stats['near_ties'] > 1 else ''}")
    if prefill and stats.get("n_prefilled") is not None:
        parts.append(f"prefill {stats['n_prefilled']} tokens in {stats['prefill_s']:.2f}s")
    return " · ".join(parts)


def models_table(rows, default_pair: tuple[str, str] | None = None, fits: dict[str, str] | None = None) -> None:
    """Print `specrun models` rows as a table on stdout; notes go to stderr. `fits` (alias: text)
    adds a column saying how each would run here."""
    from rich.table import Table


    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    columns = ["ALIAS", "FAMILY", "PARAMS", "QUANT", "SIZE", "LOCAL", "SPECULATES", "ALSO KNOWN AS", "DRAFT"]
    if fits:
        columns.insert(6, "HERE")
    for name in columns:
        table.add_column(name, no_wrap=True, justify="right" if name == "SIZE" else "left")
    unverified = False
    for row in rows:
        mark = "" if row.verified else "*"
        unverified |= not row.verified
        cells = [row.alias + mark, row.family or "-", row.params or "-", row.quant or "-",
                 human_size(row.size), "yes" if row.present else "",
                 row.speculation.label if row.speculation else "?", ", ".join(row.aliases), row.draft or "-"]
        if fits:
            cells.insert(6, fits.get(row.alias, "?"))
        table.add_row(*cells)
    out_console().print(table)
    if unverified:
        dim("* file name or checksum seen in one public catalog only")
    dim("speculates: tree = draft trees, chains = up to four draft chains per step (hybrids that roll back), "
        "plain only = no speculation; MTP = the file has MTP layers, which draft (--draft mtp); "
        "`specrun models --json` gives the reason")
    if fits:
        dim("here: how each would run on this machine with the default options (context, where the layers go, "
            "drafter), planned from its file or its header; no = does not fit; ? = neither to be had")
    if default_pair:
        dim(f"default: --target {default_pair[0]} --draft {default_pair[1]} (works offline)")


# ---------------------------------------------------------------------------------------------
# Reading chat messages


class LineReader:
    """Reads chat messages: line editing and history (readline) on a terminal, plain lines from a pipe.

    A message that starts with three double quotes goes on until a line that ends with them.
    """

    PROMPT = ">>> "
    MORE = "... "
    QUOTES = '"""'

    def __init__(self, history_file=None):
        self.interactive = sys.stdin.isatty()
        self.history_file = history_file
        self._readline = None
        if self.interactive:
            try:
                import readline  # line editing and history for input(); absent on some platforms
            except ImportError:
                readline = None
            self._readline = readline
            if readline is not None and history_file is not None:
                try:
                    readline.read_history_file(str(history_file))
                except OSError:
                    pass  # no history yet

    def read(self) -> str | None:
        """Return the next message, or None at end of input. Ctrl-C raises KeyboardInterrupt."""
        line = self._input(self.PROMPT)
        if line is None or not line.lstrip().startswith(self.QUOTES):
            return line
        text = line.lstrip()[len(self.QUOTES):]
        lines = []
        while not text.rstrip().endswith(self.QUOTES):
            lines.append(text)
            text = self._input(self.MORE)
            if text is None:
                return "\n".join(lines)
        lines.append(text.rstrip()[: -len(self.QUOTES)])
        return "\n".join(lines).strip("\n")

    def _input(self, prompt: str) -> str | None:
        """Return one line without its newline, or None at end of input.

        A line that is not UTF-8 raises UsageError (the chat reports it and reads on); from a
        pipe, lines are read as bytes so one bad line cannot spoil the ones after it.
        """
        if not self.interactive and getattr(sys.stdin, "buffer", None) is not None:
            raw = sys.stdin.buffer.readline()
            if not raw:
                return None
            return decode_utf8(raw, "this message").rstrip("\r\n")
        try:
            return check_utf8(input(prompt if self.interactive else ""), "this message")
        except EOFError:
            if self.interactive:
                sys.stdout.write("\n")
            return None
        except UnicodeDecodeError as e:
            raise UsageError(f"this message is not UTF-8 text (invalid byte 0x{e.object[e.start]:02x})") from None

    def close(self) -> None:
        """Save the history (best effort: a read-only home must not break leaving the chat)."""
        if self._readline is None or self.history_file is None:
            return
        try:
            self.history_file.parent.mkdir(parents=True, exist_ok=True)
            self._readline.set_history_length(1000)
            self._readline.write_history_file(str(self.history_file))
        except OSError:
            pass


def silence_stdout() -> None:
    """The reader went away (`| head`): point stdout at /dev/null so the final flush cannot fail."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass
