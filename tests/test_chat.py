"""`specrun chat`: a real terminal session under tmux, piped sessions, and the KV reuse between turns.

The terminal test drives the installed command in a tmux pane the way a person would: it types,
reads the streamed answer off the screen, presses Ctrl-C in the middle of an answer, and checks
with /stats that a new turn prefills only the new message. tmux is required (CI installs it);
without it the test fails rather than skips.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specrun.cli import app

QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."  # SmolLM2-135M F32, greedy
PLAIN = ["--target", "smollm2-135m-f32", "--no-spec", "--threads", "1", "--ctx-size", "512"]

STATUS_RE = re.compile(r"^(\d+) tokens · [\d.]+ tok/s · [\d.]+ accepted/pass")
PROMPT_STATS_RE = re.compile(r"last prompt: (\d+) tokens · (\d+) reused from the KV cache · (\d+) prefilled")
WAIT = 180.0  # seconds; generous because the CPU is shared with other test runs
EXIT_MARK = "[command exited with status "  # printed by the shell around the command (Pane.start)


# ---------------------------------------------------------------------------------------------
# A real terminal


class Pane:
    """One command running in a tmux pane on a private tmux server."""

    def __init__(self, tmp_path: Path):
        if shutil.which("tmux") is None:
            pytest.fail(
                "tmux is not installed: the chat terminal test needs it (apt-get install tmux; .ci/run installs it)",
                pytrace=False,
            )
        self.socket = f"specrun-test-{uuid.uuid4().hex[:8]}"
        self.conf = tmp_path / "tmux.conf"
        # Keep the pane after the command exits, so its exit status can be read.
        self.conf.write_text("set -g remain-on-exit on\nset -g history-limit 20000\n")

    def tmux(self, *args: str) -> str:
        out = subprocess.run(["tmux", "-L", self.socket, "-f", str(self.conf), *args], capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise AssertionError(f"tmux {' '.join(args)} failed: {out.stderr.strip()}")
        return out.stdout

    def start(self, *argv: str) -> None:
        # A shell around the command prints its exit status: tmux 3.3 can mark a pane dead
        # without ever reporting the status of the process that ran in it. The shell catches
        # Ctrl-C (doing nothing) so it outlives the command; the command gets Ctrl-C as usual.
        wrapped = ("sh", "-c", f'trap : INT; "$@"; echo "{EXIT_MARK}$?]"', "sh", *argv)
        self.tmux("new-session", "-d", "-s", "chat", "-x", "200", "-y", "50", "--", *wrapped)

    def text(self) -> str:
        """Return everything the pane has shown, wrapped lines joined."""
        return self.tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "chat")

    def type(self, line: str) -> None:
        self.tmux("send-keys", "-t", "chat", "-l", line)
        self.tmux("send-keys", "-t", "chat", "Enter")

    def key(self, key: str) -> None:
        self.tmux("send-keys", "-t", "chat", key)

    def exit_status(self) -> int | None:
        """Return the command's exit status (128 + signal if a signal ended it), or None while it runs."""
        found = re.findall(re.escape(EXIT_MARK) + r"(\d+)\]", self.text())
        return int(found[-1]) if found else None

    def wait_for(self, what: str, done, timeout: float = WAIT) -> str:
        """Poll the screen until done(text) is true; fail with the screen if it never is."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.text()
            if done(text):
                return text
            if time.monotonic() > deadline or self.exit_status() is not None:
                pytest.fail(f"waiting for {what}; the screen shows:\n{text}", pytrace=False)
            time.sleep(0.2)

    def wait_exit(self, timeout: float = 60.0) -> int:
        """Return the command's exit status once it has ended."""
        deadline = time.monotonic() + timeout
        while (status := self.exit_status()) is None:
            if time.monotonic() > deadline:
                state = self.tmux("display-message", "-p", "-t", "chat", "#{pane_dead}:#{pane_dead_status}:#{pane_dead_signal}:#{pane_pid}")
                pytest.fail(f"the command did not end ({state.strip()}); the screen shows:\n{self.text()}", pytrace=False)
            time.sleep(0.2)
        return status

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=30)


def lines(text: str) -> list[str]:
    """Return the screen's lines without trailing spaces, and without the empty rows below the last."""
    return [line.rstrip() for line in text.rstrip().splitlines()]


def answers_done(n: int):
    """Return a check: n status lines shown, and the prompt back after the last of them."""

    def done(text: str) -> bool:
        rows = lines(text)
        status = [i for i, row in enumerate(rows) if STATUS_RE.match(row)]
        return len(status) >= n and ">>>" in rows[status[n - 1] + 1 :]

    return done


def answer_of(text: str, question: str) -> tuple[str, str]:
    """Return (the answer printed after the question, its status line)."""
    rows = lines(text)
    start = rows.index(f">>> {question}") + 1
    end = next(i for i in range(start, len(rows)) if STATUS_RE.match(rows[i]))
    return "\n".join(rows[start:end]), rows[end]


def prompt_stats(text: str) -> list[tuple[int, int, int]]:
    return [tuple(map(int, m.groups())) for m in PROMPT_STATS_RE.finditer(text)]


@pytest.fixture
def pane(tmp_path, offline_models):
    p = Pane(tmp_path)
    yield p
    p.close()


def test_chat_in_a_terminal(pane):
    pane.start(
        "env", "-u", "NO_COLOR", sys.executable, "-m", "specrun", "chat",
        "--max-tokens", "300", "--threads", "1", "--ctx-size", "1024",
    )
    pane.wait_for("the prompt", lambda t: ">>>" in lines(t))
    assert "with draft smollm2-135m-q4" in pane.text()  # the demo pair, speculating

    # 1. a question; the answer streams onto the screen, then the status line
    pane.type(QUESTION)
    screen = pane.wait_for("the first answer", answers_done(1))
    answer, status = answer_of(screen, QUESTION)
    assert answer == ANSWER
    n1 = int(STATUS_RE.match(status).group(1))

    pane.type("/stats")
    screen = pane.wait_for("/stats", lambda t: len(prompt_stats(t)) == 1 and lines(t)[-1] == ">>>")
    [(prompt1, reused1, prefilled1)] = prompt_stats(screen)
    assert reused1 == 0 and prefilled1 == prompt1  # nothing to reuse yet

    # 2. Ctrl-C in the middle of a long answer returns to the prompt
    story = "Write a very long story about a dragon and a knight."
    pane.type(story)
    pane.wait_for("the story to start streaming", lambda t: len(t.split(f">>> {story}", 1)[-1].strip()) > 80)
    pane.key("C-c")
    pressed = time.monotonic()
    screen = pane.wait_for("the prompt after Ctrl-C", answers_done(2), timeout=60)
    assert time.monotonic() - pressed < 30
    story_text, status = answer_of(screen, story)
    assert status.endswith("· stopped")
    n2 = int(STATUS_RE.match(status).group(1))
    assert 10 < n2 < 300 and story_text

    # 3. the next turn prefills only the new message: the history comes from the KV cache
    followup = "And what is the capital of Italy?"
    pane.type(followup)
    screen = pane.wait_for("the third answer", answers_done(3))
    # (what the tiny model answers depends on how much story came before: only that it answers)
    assert answer_of(screen, followup)[0]
    pane.type("/stats")
    screen = pane.wait_for("/stats", lambda t: len(prompt_stats(t)) == 2 and lines(t)[-1] == ">>>")
    prompt3, reused3, prefilled3 = prompt_stats(screen)[1]
    assert reused3 + prefilled3 == prompt3
    # everything before: turn 1's prompt and answer, the stopped story (its last token is the
    # only one a decoder may still hold back)
    assert reused3 >= prompt1 + n1 + n2 - 1
    # the new message with its turn markup (and the end marker of the stopped answer)
    assert prefilled3 <= 30

    # 4. line editing with history: Up recalls the last line, Ctrl-U clears it
    pane.key("Up")
    pane.wait_for("the recalled line", lambda t: lines(t)[-1] == ">>> /stats")
    pane.key("C-u")
    pane.wait_for("the cleared line", lambda t: lines(t)[-1] == ">>>")

    # 5. Ctrl-C at the prompt says how to leave; /exit leaves
    pane.key("C-c")
    pane.wait_for("the hint", lambda t: "Ctrl-C again or Ctrl-D to leave" in t)
    pane.type("/exit")
    assert pane.wait_exit() == 0
    assert "Traceback" not in pane.text()
    history = (Path(os.environ["SPECRUN_CONFIG"]) / "chat_history").read_text()
    assert QUESTION in history and followup in history  # kept for the next chat


# ---------------------------------------------------------------------------------------------
# Piped chats (no terminal): the same commands, plain output


@pytest.fixture
def chat(offline_models):
    runner = CliRunner()

    def run(*lines_in: str, args=PLAIN):
        return runner.invoke(app, ["chat", *args], input="".join(f"{line}\n" for line in lines_in))

    return run


def test_piped_chat_answers_and_runs_commands(chat, tmp_path):
    saved_json, saved_md = tmp_path / "chat.json", tmp_path / "notes" / "chat.md"

    result = chat(QUESTION, f"/save {saved_json}", f"/save {saved_md}", "/frobnicate", "/reset", "/stats", "/exit", "never answered")

    assert result.exit_code == 0, result.output
    assert result.stdout == ANSWER + "\n"  # only the answer: no prompts or status on stdout
    assert "unknown command /frobnicate" in result.stderr
    assert "new conversation" in result.stderr
    data = json.loads(saved_json.read_text())
    assert data["model"] == "smollm2-135m-f32"
    assert data["messages"] == [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER}]
    markdown = saved_md.read_text()
    assert markdown.index("## User") < markdown.index(QUESTION) < markdown.index("## Assistant") < markdown.index(ANSWER)


def test_save_to_an_unwritable_place_keeps_chatting(chat, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")

    result = chat(f"/save {blocker}/chat.json", "/help", "/exit")

    assert result.exit_code == 0
    assert "error: cannot write" in result.stderr and "/reset" in result.stderr


def test_full_context_is_reported_and_reset_recovers(chat):
    # A long system prompt (~244 tokens) leaves room for a short answer only.
    system = "You are a storyteller. Tell long stories full of detail. " * 17
    args = [*PLAIN[:-1], "256", "--system", system]

    # (no /exit: the end of the input ends the chat, like Ctrl-D)
    result = chat("Write a long story about a dragon.", "Another one, please.", "/reset", "/stats", args=args)

    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2
    assert "the context is full" in warnings[0] and "/reset" in warnings[0]  # the answer was cut
    assert "fills the context" in warnings[1] and "/reset" in warnings[1]  # no room for another
    assert "system prompt kept" in result.stderr


# ---------------------------------------------------------------------------------------------
# The session: exact tokens between turns


@pytest.fixture(scope="module")
def runtime(offline_models):
    from specrun.runtime.plan import RunOptions
    from specrun.runtime.runtime import Runtime

    with Runtime(RunOptions(target="smollm2-135m-f32", no_spec=True, threads=1, ctx_size=512)) as rt:
        yield rt


def ask(session, text: str) -> str:
    from specrun.core.sampling import SamplingParams

    return "".join(session.ask(text, SamplingParams(), 40))


def test_next_turn_appends_to_the_tokens_already_seen(runtime):
    from specrun.chat.session import ChatSession

    session = ChatSession(runtime)
    assert ask(session, QUESTION) == ANSWER
    assert session.last.n_reused == 0
    seen = list(session.tokens)

    prompt, _ = session.prompt_for("And of Italy?")

    # the history is kept token for token (not re-tokenized), and it is what the template
    # would write for the whole conversation
    assert prompt[: len(seen)] == seen
    fmt = session.format
    whole = fmt.tokenize_start(fmt.render(session.messages + [{"role": "user", "content": "And of Italy?"}]))
    assert prompt == whole

    ask(session, "And of Italy?")
    # only the last answer token (never decoded: the turn ended on it) and the new message are new
    assert session.last.n_reused == len(seen) - 1
    assert session.last.n_prefilled == len(prompt) - len(seen) + 1


def test_a_seeded_sampled_turn_reports_no_reused_tokens(runtime):
    from specrun.chat.session import ChatSession
    from specrun.core.sampling import SamplingParams

    # A seeded sample prefills its whole prompt afresh (SamplingParams.reproducible): the turn's
    # figures say so, and the next unseeded turn reuses the conversation again.
    session = ChatSession(runtime)
    ask(session, QUESTION)
    "".join(session.ask("And of Italy?", SamplingParams(temperature=0.8, seed=5), 8))
    assert session.last.n_reused == 0 and runtime.decoder.stats.n_prefilled == session.last.n_prompt
    ask(session, "And of Spain?")
    assert session.last.n_reused > 0 and runtime.decoder.stats.n_prefilled == session.last.n_prefilled


def test_interrupted_step_resets_the_cache_and_the_chat_goes_on(runtime):
    from specrun.chat.session import ChatSession

    session = ChatSession(runtime)
    decoder = runtime.decoder
    real_steps = decoder.steps

    def steps_then_ctrl_c(*args, **kwargs):
        for i, step in enumerate(real_steps(*args, **kwargs)):
            yield step
            if i == 2:
                raise KeyboardInterrupt  # a second Ctrl-C lands inside a step

    decoder.steps = steps_then_ctrl_c
    try:
        with pytest.raises(KeyboardInterrupt):
            ask(session, QUESTION)
    finally:
        del decoder.steps

    assert decoder.cache.tokens == [] and session.last.n_tokens == 3  # what was shown stays in the chat
    assert len(session.messages) == 2
    session.reset()
    assert ask(session, QUESTION) == ANSWER  # a clean cache gives the same answer as ever


def test_gemma_without_a_template_gets_its_own_turn_format(offline_models):
    # The Gemma 3 270M GGUF ships no chat template; ChatML would be the wrong format for it.
    from specrun.runtime.plan import RunOptions
    from specrun.runtime.runtime import Runtime

    with Runtime(RunOptions(target="gemma3-270m-q4", no_spec=True, threads=1, ctx_size=256)) as rt:
        assert rt.target.chat_template is None
        prompt = rt.tokenize_prompt("Say hello.", system="Be brief.")
        text = rt.target.detokenize(prompt, special=True)

    assert text == "<bos><start_of_turn>user\nBe brief.\n\nSay hello.<end_of_turn>\n<start_of_turn>model\n"


def test_chat_says_when_the_model_has_no_template_of_its_own(cli):
    """Gemma 3 270M's file has no chat template (a base model): chat renders Gemma's turn format,
    and says so once, so that a model that does not follow turns is not taken for a bug. A model
    with its own template chats without the warning."""
    bare = cli("chat", "--target", "gemma3-270m-f32", "--no-spec", "-n", "2", input="Hi\n")
    assert bare.exit_code == 0, bare.output
    said = [line for line in bare.stderr.splitlines() if "no chat template in its file" in line]
    assert len(said) == 1 and "gemma3's turn format" in said[0] and "--chat-template" in said[0]
    own = cli("chat", "--no-spec", "-n", "2", input="Hi\n")
    assert own.exit_code == 0 and "no chat template" not in own.stderr
