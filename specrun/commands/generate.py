"""`specrun generate`: one prompt streamed to stdout, or JSONL requests answered line by line."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import IO

from specrun import ui
from specrun.errors import SpecrunError, UsageError
from specrun.runtime.plan import RunOptions
from specrun.runtime.request import Request, run_request
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
    request.sampling()  # validate before loading anything
    if not text.strip():
        raise UsageError("the prompt is empty")
    with Runtime(opts) as rt:
        announce(rt)
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
        "drafter": rt.plan.drafter,
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
        announce(rt)
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

