"""`specrun generate`: one prompt streamed to stdout, one prompt per input line (--lines), or JSONL
requests answered line by line (--jsonl). Models load once per command."""

from __future__ import annotations

import collections
import json
import logging
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from specrun import ui
from specrun.decoding.steps import GenerationStats
from specrun.engine import rpc
from specrun.errors import SpecrunError, UsageError
from specrun.inputs import decode_utf8
from specrun.runtime import request_json
from specrun.runtime.plan import RunOptions
from specrun.runtime.pool import DecoderPool, Lease
from specrun.runtime.request import Request, logprob_json, run_request
from specrun.runtime.runtime import Runtime

log = logging.getLogger("specrun")


def announce(rt: Runtime) -> None:
    """Say (with --verbose) which models and which tree this run uses."""
    if rt.speculative:
        log.info("target %s, draft %s, drafter %s: %s", rt.models.target_name, rt.models.draft_name or "none",
                 rt.plan.drafter, rt.plan.tree.describe())
    else:
        log.info("target %s, plain decoding", rt.models.target_name)


def generate_one(opts: RunOptions, request: Request, text: str, show_stats: bool = False, as_json: bool = False) -> None:
    """Generate for one prompt: stream text to stdout, or print one JSON object."""
    request.check()  # validate before loading anything
    if not text.strip():
        raise UsageError("the prompt is empty")
    with Runtime(opts) as rt:
        announce(rt)
        _answer(rt, request, text, show_stats, as_json)


def _answer(rt: Runtime, request: Request, text: str, show_stats: bool, as_json: bool) -> None:
    """Answer one prompt on loaded models: streamed text or one JSON line; a cut-short answer says so."""
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
    stats = result.stats.as_dict()
    if stats["finish_reason"] == "context":
        ui.warn(f"the context is full ({rt.target_ctx.n_ctx} tokens): the answer stops after "
                f"{stats['n_tokens']} tokens; a larger --ctx-size gives it room")
    if log.isEnabledFor(logging.INFO):  # --verbose
        _say_near_ties(rt, result.stats)
    if show_stats:
        ui.dim(ui.stats_line(stats) + f" · finished: {stats['finish_reason']}")
    if log.isEnabledFor(logging.INFO) and (network := rpc.round_trips_now()):
        log.info("%s", network)  # a slow worker's link shows here


def _say_near_ties(rt: Runtime, stats: GenerationStats) -> None:
    """Log one line per token the answer chose at a near-tie (docs/exactness.md)."""
    def text(token: int) -> str:
        return repr(rt.target.token_to_piece(token, special=True).decode("utf-8", "replace"))

    for tie in stats.near_ties:
        log.info("near-tie at token %d: %s over %s by %.4f nats; a pass of another shape may choose the other",
                 tie.at, text(tie.token), text(tie.runner_up), tie.gap)


def _result_json(result, rt: Runtime) -> dict:
    stats = result.stats.as_dict()
    out = {
        "text": result.text,
        "token_ids": result.tokens,
        "n_tokens": stats["n_tokens"],
        "tokens_per_s": stats["tokens_per_s"],
        "accepted_per_pass": stats["accepted_per_pass"],
        "finish_reason": stats["finish_reason"],
        "speculative": rt.speculative,
        "drafter": rt.plan.drafter,
        "stats": stats,
    }
    if result.logprobs is not None:  # one entry per token id, from the target's own softmax
        out["logprobs"] = logprob_json(rt.target, result.logprobs)
    return out


def _input_lines(file: Path | None) -> Iterator[tuple[int, bytes]]:
    """Yield (line number, raw bytes) of --file or stdin; bytes, so each line is decoded on its own."""
    if file is not None:
        try:
            stream: BinaryIO = file.open("rb")
        except OSError as e:
            raise UsageError(f"cannot read {file}: {e.strerror}") from None
    else:
        stream = getattr(sys.stdin, "buffer", None)
        if stream is None:  # a text-only stdin (embedding): encode back, surrogates kept for the check
            stream = iter([line.encode("utf-8", "surrogatepass") for line in sys.stdin])
    try:
        yield from enumerate(stream, start=1)
    finally:
        if file is not None:
            stream.close()


def generate_jsonl(opts: RunOptions, base: Request, file: Path | None) -> None:
    """Answer one JSON request per input line with one JSON result (or error) per output line.

    Every non-blank line gets its own line of output, in order, whatever happens to the others.
    """
    with Runtime(opts) as rt:
        announce(rt)
        if len(rt.decoders) > 1:
            _jsonl_together(rt, base, file)
            return
        for line_no, raw in _input_lines(file):
            if not raw.strip():
                continue
            print(request_json.dumps(_jsonl_result(rt, base, line_no, raw)), flush=True)


def _jsonl_together(rt: Runtime, base: Request, file: Path | None) -> None:
    """--jsonl --parallel N: up to N lines decode at once, each with a decoder of its own (their
    target passes shared); each result is printed once every line before it was."""
    pool = DecoderPool(rt.decoders)
    _ = rt.chat_format  # made once, before the threads share it
    pending: collections.deque = collections.deque()
    with ThreadPoolExecutor(len(rt.decoders)) as threads:
        for line_no, raw in _input_lines(file):
            if not raw.strip():
                continue
            pending.append(threads.submit(_jsonl_result, rt, base, line_no, raw, pool))
            while pending and (pending[0].done() or len(pending) > 2 * len(rt.decoders)):
                print(request_json.dumps(pending.popleft().result()), flush=True)
        while pending:
            print(request_json.dumps(pending.popleft().result()), flush=True)


def _jsonl_result(rt: Runtime, base: Request, line_no: int, raw: bytes, pool: DecoderPool | None = None) -> dict:
    line = ""
    try:
        line = decode_utf8(raw, f"line {line_no}")
        request, prompt, req_id = request_json.parse_line(line, base)
    except request_json.FieldError as e:
        return _with_id({"error": str(e), "line": line_no, "field": e.field}, line)
    except UsageError as e:
        return _with_id({"error": str(e), "line": line_no}, line)
    lease = Lease(pool) if pool is not None else None
    try:
        out = _result_json(run_request(rt, request, prompt, lease=lease), rt)
    except Exception as e:  # one line's failure must not end the batch
        out = {"error": _failure_text(e), "line": line_no}
        # A failure inside a decoder step may leave half a step in its caches (none was taken
        # when the prompt itself failed: then no decoder is reset, another line may be using it).
        decoder = rt.decoder if lease is None else lease.decoder
        if decoder is not None:
            decoder.reset()
    finally:
        if lease is not None:
            lease.give_back()
    return _with_id(out, line, req_id)


def _with_id(out: dict, line: str, req_id=None) -> dict:
    if req_id is None and line:
        req_id = request_json.line_id(line)
    if req_id is not None:
        out["id"] = req_id
    return out


def _failure_text(error: Exception) -> str:
    if isinstance(error, SpecrunError):
        return str(error)
    log.debug("request failed", exc_info=error)
    return f"unexpected {type(error).__name__}: {error}"


def generate_lines(opts: RunOptions, request: Request, file: Path | None, show_stats: bool, as_json: bool) -> int:
    """Answer each non-blank input line as a prompt of its own; return the number of lines refused.

    Text answers follow one another separated by a blank line; with as_json, one JSON object per
    line (an error object for a line that could not be answered).
    """
    request.check()  # validate before loading anything
    failed = 0
    first = True
    with Runtime(opts) as rt:
        announce(rt)
        for line_no, raw in _input_lines(file):
            if not raw.strip():
                continue
            try:
                text = decode_utf8(raw, f"line {line_no}")
                if not first and not as_json:
                    ui.write_text("\n")
                first = False
                _answer(rt, request, text, show_stats, as_json)
            except SpecrunError as e:
                failed += 1
                rt.reset_cache()
                if as_json:
                    print(json.dumps({"error": str(e), "line": line_no}), flush=True)
                else:
                    ui.error(f"line {line_no}: {e}" if not str(e).startswith("line ") else str(e))
    return failed
