"""`specrun chat`: the terminal chat loop (prompt, Ctrl-C, /commands, status lines)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from specrun import paths, ui
from specrun.chat import reasoning
from specrun.chat.reasoning import ChatSettings
from specrun.chat.session import ChatSession
from specrun.commands.generate import announce
from specrun.errors import ContextFullError, SpecrunError
from specrun.runtime.plan import RunOptions
from specrun.runtime.request import Request
from specrun.runtime.runtime import Runtime

CHAT_HELP = """\
/help          this list
/reset         start a new conversation (the --system prompt stays)
/stats         numbers for the last answer and the whole session
/save [FILE]   write the conversation: FILE.json as JSON, anything else as Markdown
/exit          leave (also /quit, /bye, Ctrl-D, or Ctrl-C twice at the prompt)
Ctrl-C while an answer streams stops it and returns to the prompt.
A message that starts with \"\"\" may span lines; end it with \"\"\". Start with // to send a text that begins with /."""


def chat(opts: RunOptions, request: Request, max_tokens: int | None, settings: ChatSettings = ChatSettings()) -> None:
    """Run an interactive chat with the target on the terminal (or over piped lines)."""

    params = request.sampling()  # validate before loading anything
    with Runtime(opts) as rt:
        announce(rt)
        if settings.template is not None:
            rt.chat_format.template = settings.template
        session = ChatSession(rt, system=request.system)
        ui.dim(f"specrun chat: {rt.models.target_name} {rt.drafting()}, {session.n_ctx}-token context")
        if settings.template is None and rt.target.chat_template is None:
            # A file without a template is often a base model, which continues text and does not
            # follow turns: said once, so babble is not taken for a bug of specrun's.
            fmt = "ChatML" if rt.chat_format.template is None else f"{rt.target.architecture}'s turn format"
            ui.warn(f"{rt.models.target_name} has no chat template in its file: chatting in {fmt} "
                    "(a base model may not follow a conversation; --chat-template FILE gives one)")
        reader = ui.LineReader(paths.config_dir() / "chat_history")
        if reader.interactive:
            ui.dim("/help for commands, Ctrl-D to leave")
        try:
            _chat_loop(session, reader, params, max_tokens, settings.reasoning_format)
        finally:
            reader.close()


def _chat_loop(session, reader, params, max_tokens: int | None, reasoning_format: str) -> None:
    interrupted = False  # Ctrl-C at the prompt once: a second one in a row leaves
    while True:
        try:
            line = reader.read()
        except SpecrunError as e:  # e.g. a line that is not UTF-8: say so, the chat goes on
            ui.error(str(e))
            continue
        except KeyboardInterrupt:
            if interrupted:
                ui.write_text("\n")
                return
            interrupted = True
            ui.write_text("\n")
            ui.dim("(Ctrl-C again or Ctrl-D to leave; /help for commands)")
            continue
        interrupted = False
        if line is None:
            return
        text = line.strip()
        if not text:
            continue
        if text.startswith("/") and not text.startswith("//"):
            if not _chat_command(session, text):
                return
            continue
        _answer(session, text[1:] if text.startswith("//") else text, params, max_tokens, reasoning_format)


def _chat_command(session, text: str) -> bool:
    """Run one /command; return False when the chat should end."""
    name, _, arg = text.partition(" ")
    name, arg = name.lower(), arg.strip()
    if name in ("/exit", "/quit", "/bye"):
        return False
    if name in ("/help", "/?"):
        ui.info(CHAT_HELP)
    elif name == "/reset":
        session.reset()
        ui.dim("new conversation" + (" (system prompt kept)" if session.system else ""))
    elif name == "/stats":
        ui.info(_session_stats(session))
    elif name == "/save":
        path = Path(arg) if arg else Path(session.started.strftime("specrun-chat-%Y%m%d-%H%M%S.md"))
        try:
            kind = session.save(path)
        except SpecrunError as e:
            ui.error(str(e))
        else:
            ui.dim(f"saved {len(session.messages)} messages to {path} ({kind})")
    else:
        ui.error(f"unknown command {name}; /help lists the commands (start with // to send text beginning with /)")
    return True


class _StopOnInterrupt:
    """While an answer streams, the first Ctrl-C asks to stop after the current decoder step
    (the KV cache stays consistent); a second one interrupts at once, unless the answer is
    already being wound up (`abortable` false)."""

    def __enter__(self) -> "_StopOnInterrupt":
        self.requested = False
        self.abortable = True
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum, frame) -> None:
        if self.requested and self.abortable:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _answer(session, text: str, params, max_tokens: int | None, reasoning_format: str = "auto") -> None:
    """Stream one answer to stdout, then the dim status line (or say why there is no answer)."""
    last = ""
    shown = _AnswerDisplay(session, reasoning_format)
    try:
        with _StopOnInterrupt() as stop:
            answer = session.ask(text, params, max_tokens)
            try:
                for piece in answer:
                    last = shown.write(piece) or last
                    if stop.requested:
                        break
                last = shown.finish() or last
            finally:
                stop.abortable = False  # recording the turn must not be cut in half
                answer.close()
    except KeyboardInterrupt:
        ui.end_text(last)
        ui.dim("stopped")
        return
    except ContextFullError as e:
        ui.end_text(last)
        ui.warn(str(e))
        return
    except SpecrunError as e:
        ui.end_text(last)
        ui.error(str(e))
        return
    ui.end_text(last)
    turn = session.last
    line = ui.stats_line(
        {"n_tokens": turn.n_tokens, "tokens_per_s": turn.tokens_per_s,
         "n_passes": turn.n_passes, "accepted_per_pass": turn.accepted_per_pass,
         "lookup_tokens": turn.lookup_tokens, "draft_tokens": turn.draft_tokens}, prefill=False
    )
    if turn.finish_reason == "stopped":
        line += " · stopped"
    elif turn.finish_reason == "length":
        line += " · reached --max-tokens"
    ui.dim(line)
    if turn.finish_reason == "context":
        ui.warn(f"the context is full ({session.n_used} of {session.n_ctx} tokens): "
                "/reset starts a new conversation (or restart with a larger --ctx-size)")


class _AnswerDisplay:
    """Writes an answer: a reasoning model's thinking dimmed on stderr, the rest on stdout."""

    def __init__(self, session, reasoning_format: str):
        template = session.format.template
        # The generation prompt does not depend on the conversation: render a one-line one to see
        # whether the template opens <think> itself.
        probe = session.format.render([{"role": "user", "content": "."}]).text if reasoning.template_syntax(template) else ""
        self.parser = reasoning.parser_for(template, probe, reasoning_format)
        self.thinking = False  # a line of thinking is open on stderr

    def write(self, text: str) -> str:
        """Show a piece; return what went to stdout."""
        if self.parser is None:
            ui.write_text(text)
            return text
        return self._show(self.parser.feed(text))

    def finish(self) -> str:
        """Show what the parser held back and end an open line of thinking; return what went to stdout."""
        if self.parser is None:
            return ""
        shown = self._show(self.parser.finish())
        if self.thinking:
            ui.thinking("\n")
            self.thinking = False
        return shown

    def _show(self, split: reasoning.Split) -> str:
        if split.reasoning:
            ui.thinking(split.reasoning.lstrip("\n") if not self.thinking else split.reasoning)
            self.thinking = True
        if split.content:
            if self.thinking:
                ui.thinking("\n")
                self.thinking = False
            ui.write_text(split.content)
        return split.content


def _session_stats(session) -> str:
    """Return the text of /stats: the last answer, its prompt's KV reuse, the session, the context."""
    rt = session.rt
    lines = []
    turn = session.last
    if turn is None:
        lines.append("no answers yet")
    else:
        lines.append(
            f"last answer: {turn.n_tokens} tokens in {turn.decode_s:.2f}s · {turn.tokens_per_s:.1f} tok/s · "
            f"{turn.accepted_per_pass:.2f} accepted/pass · {turn.n_passes} target passes · ended: {turn.finish_reason}"
        )
        if rt.speculative:
            lines.append(f"last answer's accepted drafts: {turn.lookup_tokens} from lookup, "
                         f"{turn.draft_tokens} from the draft model")
        lines.append(
            f"last prompt: {turn.n_prompt} tokens · {turn.n_reused} reused from the KV cache · "
            f"{turn.n_prefilled} prefilled in {turn.prefill_s:.2f}s"
        )
    t = session.totals
    tps = t.n_tokens / t.decode_s if t.decode_s > 0 else 0.0
    per_pass = t.n_tokens / t.n_passes if t.n_passes else 0.0
    lines.append(
        f"session: {t.turns} answers · {t.n_tokens} tokens · {tps:.1f} tok/s · {per_pass:.2f} accepted/pass · "
        f"{t.n_prefilled} tokens prefilled"
    )
    if rt.speculative:
        lines.append(f"session's accepted drafts: {t.lookup_tokens} from lookup, {t.draft_tokens} from the draft model")
    lines.append(f"context: {session.n_used} of {session.n_ctx} tokens used")
    if rt.speculative:
        lines.append(f"models: target {rt.models.target_name}, drafter {rt.plan.drafter}: {rt.plan.tree.describe()}")
    else:
        lines.append(f"models: target {rt.models.target_name}, plain decoding")
    return "\n".join(lines)
