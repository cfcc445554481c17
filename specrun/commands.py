"""What the CLI commands do, as plain functions (the CLI only parses options and calls these)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Iterable

from specrun import ui
from specrun.errors import SpecrunError, UsageError
from specrun.runner import RunOptions, Runtime


@dataclass(frozen=True)
class Request:
    """One generation request: sampling settings and limits."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    chat: bool | None = None  # None: chat mode when the model has a chat template
    system: str | None = None

    def sampling(self):
        from specrun.sampling import SamplingParams

        return SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p, self.seed)


def _announce(rt: Runtime) -> None:
    import logging

    log = logging.getLogger("specrun")
    if rt.speculative:
        s = rt.shape
        log.info("target %s, draft %s, tree budget %d depth %d width %d top-k %d",
                 rt.models.target_name, rt.models.draft_name, s.budget, s.depth, s.width, s.top_k)
    else:
        log.info("target %s, plain decoding", rt.models.target_name)


def run_request(rt: Runtime, request: Request, text: str, on_text=None):
    """Generate for one prompt text; call on_text(chunk) as text streams; return the Result."""
    from specrun.generate import Result, stream

    prompt = rt.tokenize_prompt(text, request.chat, request.system)
    decoder = rt.decoder
    parts: list[str] = []
    tokens: list[int] = []
    for chunk in stream(decoder, rt.target, prompt, request.sampling(), request.max_tokens, request.stop):
        if on_text is not None:
            on_text(chunk.text)
        parts.append(chunk.text)
        tokens.extend(chunk.tokens)
    return Result("".join(parts), tokens, decoder.stats)


def generate_one(opts: RunOptions, request: Request, text: str, show_stats: bool = False, as_json: bool = False) -> None:
    """Generate for one prompt: stream text to stdout, or print one JSON object."""
    request.sampling()  # validate before loading anything
    if not text.strip():
        raise UsageError("the prompt is empty")
    with Runtime(opts) as rt:
        _announce(rt)
        if as_json:
            result = run_request(rt, request, text)
            print(json.dumps(_result_json(result, rt), ensure_ascii=False), flush=True)
        else:
            last = ""

            def show(piece: str) -> None:
                nonlocal last
                ui.write_text(piece)
                last = piece or last

            try:
                result = run_request(rt, request, text, on_text=show)
            finally:
                ui.end_text(last)  # also after Ctrl-C: the shell prompt starts on its own line
        if show_stats:
            ui.dim(ui.stats_line(result.stats.as_dict()))


def _result_json(result, rt: Runtime) -> dict:
    stats = result.stats.as_dict()
    return {
        "text": result.text,
        "token_ids": result.tokens,
        "n_tokens": stats["n_tokens"],
        "tokens_per_s": stats["tokens_per_s"],
        "accepted_per_pass": stats["accepted_per_pass"],
        "finish_reason": stats["finish_reason"],
        "speculative": rt.speculative,
        "stats": stats,
    }


_JSONL_KEYS = {"prompt", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "chat", "system", "id"}


def _parse_request_line(line: str, base: Request) -> tuple[Request, str, object]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise UsageError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise UsageError("each line must be a JSON object")
    unknown = set(obj) - _JSONL_KEYS
    if unknown:
        raise UsageError(f"unknown key(s): {', '.join(sorted(unknown))}")
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise UsageError('missing "prompt" (a non-empty string)')
    fields = {k: obj[k] for k in obj if k not in ("prompt", "id")}
    if "stop" in fields:
        stop = fields["stop"]
        fields["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
    try:
        request = replace(base, **fields)
        request.sampling()
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
    if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
        raise UsageError("max_tokens must be a whole number >= 1")
    return request, prompt, obj.get("id")


def _line_id(line: str):
    """Return the "id" of a request line that failed, if it has one, so results can be matched."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return None
    return obj.get("id") if isinstance(obj, dict) else None


def generate_jsonl(opts: RunOptions, base: Request, file: Path | None) -> None:
    """Answer one JSON request per input line with one JSON result per output line."""
    stream: IO[str] = file.open(encoding="utf-8") if file else sys.stdin
    with Runtime(opts) as rt:
        _announce(rt)
        for line_no, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            req_id = None
            try:
                request, prompt, req_id = _parse_request_line(line, base)
                out = _result_json(run_request(rt, request, prompt), rt)
            except SpecrunError as e:
                out = {"error": str(e), "line": line_no}
                req_id = _line_id(line)
                # A failure inside a decoder step may leave half a step in the caches.
                rt.reset_cache()
            if req_id is not None:
                out["id"] = req_id
            print(json.dumps(out, ensure_ascii=False), flush=True)


# ---------------------------------------------------------------------------------------------
# chat

CHAT_HELP = """\
/help          this list
/reset         start a new conversation (the --system prompt stays)
/stats         numbers for the last answer and the whole session
/save [FILE]   write the conversation: FILE.json as JSON, anything else as Markdown
/exit          leave (also /quit, /bye, Ctrl-D, or Ctrl-C twice at the prompt)
Ctrl-C while an answer streams stops it and returns to the prompt.
A message that starts with \"\"\" may span lines; end it with \"\"\". Start with // to send a text that begins with /."""


def chat(opts: RunOptions, request: Request, max_tokens: int | None) -> None:
    """Run an interactive chat with the target on the terminal (or over piped lines)."""
    from specrun import paths
    from specrun.chat import ChatSession

    params = request.sampling()  # validate before loading anything
    with Runtime(opts) as rt:
        _announce(rt)
        session = ChatSession(rt, system=request.system)
        if rt.speculative:
            how = f"with draft {rt.models.draft_name} (tree budget {rt.shape.budget})"
        else:
            how = "without a draft (plain decoding)"
        ui.dim(f"specrun chat: {rt.models.target_name} {how}, {session.n_ctx}-token context")
        reader = ui.LineReader(paths.config_dir() / "chat_history")
        if reader.interactive:
            ui.dim("/help for commands, Ctrl-D to leave")
        try:
            _chat_loop(session, reader, params, max_tokens)
        finally:
            reader.close()


def _chat_loop(session, reader, params, max_tokens: int | None) -> None:
    interrupted = False  # Ctrl-C at the prompt once: a second one in a row leaves
    while True:
        try:
            line = reader.read()
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
        _answer(session, text[1:] if text.startswith("//") else text, params, max_tokens)


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
        import signal
        import threading

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
        import signal

        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _answer(session, text: str, params, max_tokens: int | None) -> None:
    """Stream one answer to stdout, then the dim status line (or say why there is no answer)."""
    from specrun.errors import ContextFullError

    last = ""
    try:
        with _StopOnInterrupt() as stop:
            answer = session.ask(text, params, max_tokens)
            try:
                for piece in answer:
                    ui.write_text(piece)
                    last = piece
                    if stop.requested:
                        break
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
         "n_passes": turn.n_passes, "accepted_per_pass": turn.accepted_per_pass}, prefill=False
    )
    if turn.finish_reason == "stopped":
        line += " · stopped"
    elif turn.finish_reason == "length":
        line += " · reached --max-tokens"
    ui.dim(line)
    if turn.finish_reason == "context":
        ui.warn(f"the context is full ({session.n_used} of {session.n_ctx} tokens): "
                "/reset starts a new conversation (or restart with a larger --ctx-size)")


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
    lines.append(f"context: {session.n_used} of {session.n_ctx} tokens used")
    if rt.speculative:
        s = rt.shape
        lines.append(f"models: target {rt.models.target_name}, draft {rt.models.draft_name} "
                     f"(tree budget {s.budget}, depth {s.depth}, width {s.width})")
    else:
        lines.append(f"models: target {rt.models.target_name}, plain decoding")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# bench

BENCH_PROMPTS = [
    "Explain why the sky is blue to a ten-year-old.",
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List five tips for staying productive when working from home.",
    "What are the main differences between TCP and UDP?",
    "Write a SQL query that finds the ten customers with the highest total order value.",
]


def load_prompts(path: Path | None) -> list[str]:
    if path is None:
        return list(BENCH_PROMPTS)
    try:
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    except OSError as e:
        raise UsageError(f"cannot read prompts file {path}: {e.strerror}") from None
    prompts = [line for line in lines if line]
    if not prompts:
        raise UsageError(f"prompts file {path} has no prompts")
    return prompts


def measure(decoder, rt: Runtime, prompts: Iterable[list[int]], max_tokens: int):
    """Return (tokens/s, accepted per pass, overhead fraction, generated ids) over the prompts."""
    from specrun.generate import token_ids
    from specrun.sampling import SamplingParams

    greedy = SamplingParams()
    n_tokens = 0
    seconds = overhead = 0.0
    passes = 0
    outputs = []
    for prompt in prompts:
        outputs.append(token_ids(decoder, prompt, greedy, max_tokens))
        stats = decoder.stats
        n_tokens += stats.n_generated
        seconds += stats.decode_s
        overhead += stats.total("overhead_s")
        passes += stats.n_passes
    return (
        n_tokens / seconds if seconds else 0.0,
        n_tokens / passes if passes else 0.0,
        overhead / seconds if seconds else 0.0,
        outputs,
    )


def bench(
    opts: RunOptions, budgets: list[int], prompts_file: Path | None, max_tokens: int, as_json: bool,
    width: int | None = None, children: int | None = None,
) -> list[dict]:
    """Compare plain and speculative decoding of the same target on the same prompts.

    Each budget grows trees of the tuned (or default) kind at that size; `width` and `children`
    override the kind's nodes expanded per draft pass and children per node.
    """
    from specrun.generate import PlainDecoder
    from specrun.speculative import SpeculativeDecoder

    texts = load_prompts(prompts_file)
    max_budget = max(budgets)
    rows = []
    # The tuned (or default) tree kind, sized for the largest budget; each budget scales it.
    with Runtime(replace(opts, budget=max_budget)) as rt:
        if not rt.speculative:
            raise UsageError(f"no draft model for {rt.models.target_name}: pass --draft")
        prompts = [rt.tokenize_prompt(t, chat=True) for t in texts]
        plain = PlainDecoder(rt.target, rt.target_ctx)
        measure(plain, rt, prompts[:1], 16)  # warm-up: first decodes pay one-time allocation
        plain_tps, _, plain_overhead, plain_out = measure(plain, rt, prompts, max_tokens)
        for budget in budgets:
            shape = _bench_shape(rt.shape, budget, opts.depth, width, children)
            spec = SpeculativeDecoder(rt.target, rt.target_ctx, rt.draft, rt.draft_ctx, shape)
            measure(spec, rt, prompts[:1], 16)
            spec_tps, per_pass, overhead, spec_out = measure(spec, rt, prompts, max_tokens)
            row = {
                "budget": budget,
                "depth": shape.depth,
                "width": shape.width,
                "top_k": shape.top_k,
                "plain_tokens_per_s": round(plain_tps, 2),
                "spec_tokens_per_s": round(spec_tps, 2),
                "speedup": round(spec_tps / plain_tps, 3) if plain_tps else 0.0,
                "accepted_per_pass": round(per_pass, 3),
                "overhead_fraction": round(overhead, 4),
                "identical_output": spec_out == plain_out,
            }
            rows.append(row)
            if as_json:
                print(json.dumps(row), flush=True)
            else:
                ui.info(
                    f"budget {budget:5d}: plain {plain_tps:7.2f} tok/s  spec {spec_tps:7.2f} tok/s  "
                    f"x{row['speedup']:.2f}  accepted/pass {per_pass:.2f}  overhead {overhead:.1%}"
                    + ("" if row["identical_output"] else "  (OUTPUT DIFFERS)")
                )
    return rows


def _bench_shape(base, budget: int, depth: int | None, width: int | None = None, children: int | None = None):
    """Return the tree for one bench budget: the base's kind (chain or tree) at that size."""
    from dataclasses import replace as with_fields

    kind = with_fields(base, width=width or base.width, top_k=children or base.top_k)
    shape = kind.resized(budget)
    return with_fields(shape, depth=depth) if depth else shape


# ---------------------------------------------------------------------------------------------
# pull and models


def pull(names: list[str], quiet: bool = False) -> list[Path]:
    """Fetch (or build) each named model, saying what and how big; print each local path on stdout."""
    from specrun import hub, registry

    specs = [registry.resolve(name) for name in names]  # a typo fails before any download
    paths = []
    for spec in specs:
        missing = hub.describe_missing(spec)
        if missing:
            ui.info(f"pulling {missing}...")
        else:
            ui.dim(f"{spec.name} is already here")
        path = Path(hub.pull(spec, progress=not quiet, console=ui.err_console()))
        print(path, flush=True)
        paths.append(path)
    return paths


def list_models(as_json: bool) -> None:
    """Print the registry's aliases: a table, or a JSON array."""
    from specrun import registry

    reg = registry.load()
    rows = registry.list_models(reg)
    if as_json:
        print(json.dumps([row.as_dict() for row in rows], ensure_ascii=False, indent=2))
    else:
        ui.models_table(rows, registry.default_pair(reg))
