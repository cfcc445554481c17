"""Ollama's API beside OpenAI's, for tools that speak only it (Home Assistant, editors, Open WebUI).

Routes: POST /api/chat and /api/generate (newline-delimited JSON streamed by default, one object
with `stream: false`), GET /api/tags, POST /api/show, GET /api/version, GET /api/ps. Any model name
is answered by the loaded pair, as on /v1. Errors are Ollama's `{"error": "..."}` with the status.

`format` ("json" or a JSON schema) and `tools` go through the same machinery as the OpenAI API's
response_format and tools (a grammar enforced at every tree node; the template's own tool-call
format, parsed at the end); calls come back in Ollama's shape, arguments as an object.

`options` take effect for temperature, top_p, top_k, min_p, seed, num_predict and stop, and
specrun's own `reproducible` (true or false only, as on /v1); the context is the server's
(`num_ctx` is read and ignored, as the model is not reloaded), and the other options (penalties,
mirostat, threads...) are accepted and ignored. Without options the sampling follows Ollama's
defaults.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from datetime import datetime, timezone
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from specrun.chat import reasoning
from specrun.chat.tools import tool_format
from specrun.runtime.request import Request as RunRequest  # (Request: the HTTP one)
from specrun.server.jobs import (
    ChatPrompt,
    ClientGone,
    EventReader,
    Finished,
    Job,
    Piece,
    Started,
    TextPrompt,
    disconnected,
)
from specrun.server.responses import new_id
from specrun.server.schemas import APIError, Message, ResponseFormat, Tool, checked, parse_body
from specrun.server.worker import ModelInfo, QueueWorker

# The Ollama API release whose shapes these routes follow; clients compare it to enable features.
OLLAMA_API_VERSION = "0.12.0"
# Ollama's sampling defaults, for requests that set no option.
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0}
# The levels `think` may name besides true and false (gpt-oss's reasoning effort), as Ollama takes them.
THINK_LEVELS = ("high", "medium", "low")
# num_predict: -1 generates until the model stops, -2 until the context is full.
UNLIMITED = (-1, -2)
_QUANT = re.compile(r"(?:^|[-_.])(I?Q\d[A-Z0-9_]*|F16|F32|BF16)(?:[-_.]|$)", re.IGNORECASE)


class Options(BaseModel):
    model_config = ConfigDict(extra="ignore")

    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = None
    num_predict: int | None = None
    stop: list[str] | None = Field(default=None, max_length=16)
    num_ctx: int | None = Field(default=None, ge=0)  # read, not used: the server's context stays
    reproducible: StrictBool = False  # specrun's own, as on /v1: the same answer whatever else runs

    @field_validator("num_predict")
    @classmethod
    def _num_predict(cls, n: int | None) -> int | None:
        if n is not None and n < 1 and n not in UNLIMITED:
            raise ValueError("num_predict must be at least 1, or -1 (until the model stops) or -2 (until the context is full)")
        return n

    def request(self, schema: dict | None) -> RunRequest:
        """Return the generation request these options ask for (the answer valid under `schema`),
        or raise a 400 naming a bad option."""
        values = {name: DEFAULTS[name] if getattr(self, name) is None else getattr(self, name) for name in DEFAULTS}
        # Ollama's seed 0 and -1 mean "random", as no seed does.
        seed = self.seed if self.seed is not None and self.seed > 0 else None
        return checked(RunRequest(max_tokens=self.token_limit(), stop=tuple(self.stop or ()), seed=seed,
                                  json_schema=None if schema is None else json.dumps(schema),
                                  reproducible=self.reproducible, **values), param="options")

    def token_limit(self) -> int | None:
        return None if self.num_predict is None or self.num_predict in UNLIMITED else self.num_predict


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = ""
    stream: StrictBool = True  # true or false only, as Ollama reads it (pydantic's lax bool takes "yes")
    options: Options = Field(default_factory=Options)
    format: Any = None
    think: bool | str | None = None
    keep_alive: Any = None

    @field_validator("think", mode="before")
    @classmethod
    def _think(cls, value: Any) -> Any:
        if value is None or isinstance(value, bool) or value in THINK_LEVELS:
            return value
        raise ValueError('must be true, false, "high", "medium" or "low"')

    @field_validator("format")
    @classmethod
    def _json_or_schema(cls, value: Any) -> Any:
        if value in (None, "", "json") or isinstance(value, dict):
            return value
        raise ValueError('format must be "json" or a JSON schema (an object)')

    @field_validator("options", mode="before")
    @classmethod
    def _options(cls, value: Any) -> Any:
        return {} if value is None else value

    def json_schema(self) -> dict | None:
        """Return the schema the answer must satisfy: "json" asks for any object, as the OpenAI
        API's json_object does (None: free text)."""
        if self.format in (None, ""):
            return None
        if self.format == "json":
            return ResponseFormat(type="json_object").answer_schema()
        return self.format

    def template_kwargs(self) -> dict:
        """Return the chat template variables `think` stands for: Qwen3-style enable_thinking, and
        gpt-oss's reasoning_effort for a level ("low", "medium", "high")."""
        if self.think is None:
            return {}
        if isinstance(self.think, str):
            return {"enable_thinking": True, "reasoning_effort": self.think}
        return {"enable_thinking": self.think}


class ChatBody(_Request):
    messages: list[Message] = Field(default_factory=list)
    tools: list[Tool] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _ollama_messages(cls, messages: Any) -> Any:
        """Refuse images; Ollama sends an assistant's thinking back as `thinking`, which becomes
        reasoning_content (what the templates read), and names a tool result's tool in `tool_name`."""
        if not isinstance(messages, list):
            return messages
        out = []
        for m in messages:
            if isinstance(m, dict):
                if m.get("images"):
                    raise ValueError("images are not supported by specrun")
                if isinstance(m.get("thinking"), str) and "reasoning_content" not in m:
                    m = dict(m, reasoning_content=m["thinking"])
                if isinstance(m.get("tool_name"), str) and "name" not in m:
                    m = dict(m, name=m["tool_name"])
            out.append(m)
        return out

    def tool_dicts(self) -> list[dict] | None:
        """Return the tools as the template's `tools` variable holds them (None: no tools)."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None


class GenerateBody(_Request):
    prompt: str = ""
    system: str | None = None
    raw: StrictBool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: Any = None

    @field_validator("suffix", "template", "images", "context")
    @classmethod
    def _unsupported(cls, value: Any, info) -> Any:
        if value not in (None, "", []):
            raise ValueError(f"{info.field_name} is not supported by specrun")
        return value


def add_ollama_routes(app: FastAPI, worker: QueueWorker) -> None:
    """Register Ollama's routes on the app."""

    @app.get("/api/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": OLLAMA_API_VERSION})

    @app.get("/api/tags")
    async def tags() -> JSONResponse:
        return JSONResponse({"models": [_listing(worker.ready_model())]})

    @app.get("/api/ps")
    async def ps() -> JSONResponse:
        info = worker.ready_model()
        entry = dict(_listing(info), expires_at="9999-12-31T23:59:59Z", size_vram=0, context_length=info.n_ctx)
        return JSONResponse({"models": [entry]})

    @app.post("/api/show")
    async def show(request: Request) -> JSONResponse:
        raw = await request.body()
        try:
            json.loads(raw or b"{}")
        except ValueError:
            raise APIError(400, "the request body is not valid JSON") from None
        return JSONResponse(_show(worker.ready_model()))

    @app.post("/api/chat")
    async def chat(request: Request) -> Response:
        body = parse_body(await request.body(), ChatBody)
        info = worker.ready_model()
        if not body.messages:  # Ollama loads the model and answers at once
            return JSONResponse(_head(info, done=True, done_reason="load", message={"role": "assistant", "content": ""}))
        messages = [m.as_template_message() for m in body.messages]
        prompt = ChatPrompt(messages, body.template_kwargs(), tools=body.tool_dicts())  # Ollama has no tool_choice: auto
        return await _answer(request, worker, body, prompt, info, chat=True)

    @app.post("/api/generate")
    async def generate(request: Request) -> Response:
        body = parse_body(await request.body(), GenerateBody)
        info = worker.ready_model()
        if not body.prompt:
            return JSONResponse(_head(info, done=True, done_reason="load", response=""))
        if body.raw:
            prompt = TextPrompt(text=body.prompt)
        else:
            system = [{"role": "system", "content": body.system}] if body.system else []
            prompt = ChatPrompt(system + [{"role": "user", "content": body.prompt}], body.template_kwargs())
        return await _answer(request, worker, body, prompt, info, chat=False)


# ---------------------------------------------------------------------------------------------
# Answers


def _now() -> str:
    return _timestamp(datetime.now(timezone.utc))


def _modified(info: ModelInfo) -> str:
    """When the model's file was written, as Ollama says when a model was pulled."""
    return _timestamp(datetime.fromtimestamp(info.modified, timezone.utc)) if info.modified else _now()


def _timestamp(when: datetime) -> str:
    return when.isoformat().replace("+00:00", "Z")


def _head(info: ModelInfo, **fields) -> dict:
    return {"model": info.target, "created_at": _now(), **fields}


def _piece(info: ModelInfo, chat: bool, text: str, thinking: str = "", done: bool = False,
           tool_calls: list[dict] | None = None, **fields) -> dict:
    if chat:
        message = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if tool_calls:
            message["tool_calls"] = tool_calls
        return _head(info, message=message, done=done, **fields)
    body = _head(info, response=text, done=done, **fields)
    if thinking:
        body["thinking"] = thinking
    return body


def _calls_apart(text: str, calls: list | None) -> tuple[str, list[dict]]:
    """Return the answer's text and its tool calls as Ollama writes them, arguments as an object. A
    call whose arguments are not a JSON object stays in the text, as Ollama leaves a call it cannot
    read."""
    ollama_calls = []
    for call in calls or ():
        arguments = _json_object(call.arguments)
        if arguments is None:
            text += json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
        else:
            ollama_calls.append({"function": {"name": call.name, "arguments": arguments}})
    return text, ollama_calls


def _json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _final_fields(started: Started, event: Finished, t0: float) -> dict:
    """Return the statistics Ollama ends an answer with, durations in nanoseconds."""
    stats = event.stats
    return {
        "done_reason": "length" if event.finish_reason == "length" else "stop",
        "total_duration": int((time.perf_counter() - t0) * 1e9),
        "load_duration": 0,
        "prompt_eval_count": started.n_prompt,
        "prompt_eval_duration": int(stats.prefill_s * 1e9),
        "eval_count": event.n_generated,
        "eval_duration": int(stats.decode_s * 1e9),
    }


async def _answer(request: Request, worker: QueueWorker, body: _Request, prompt, info: ModelInfo,
                  chat: bool) -> Response:
    t0 = time.perf_counter()
    options = body.options
    job = Job(new_id("ollama"), prompt, options.request(body.json_schema()), asyncio.get_running_loop())
    await worker.admit(job)  # its prompt read and checked now; a 400 or 503 raises here
    events = EventReader(request, job)
    try:
        started = await events.next()
    except ClientGone:
        raise disconnected() from None
    headers = {"X-Queue-Position": str(job.ahead)}
    if body.stream:
        return StreamingResponse(_lines(events, started, info, chat, t0), media_type="application/x-ndjson",
                                 headers=headers)
    try:
        answer = await events.rest()
    except ClientGone:
        raise disconnected() from None
    text, calls = _calls_apart(answer.text, answer.finished.tool_calls)
    return JSONResponse(_piece(info, chat, text, answer.reasoning.strip(), done=True, tool_calls=calls,
                               **_final_fields(started, answer.finished, t0)),
                        headers=headers)


async def _lines(events: EventReader, started: Started, info: ModelInfo, chat: bool, t0: float):
    """Yield the answer as newline-delimited JSON objects, the last one with done: true."""
    try:
        while True:
            event = await events.next()
            if isinstance(event, Piece):
                yield _line(_piece(info, chat, event.text, event.reasoning))
            elif isinstance(event, Finished):
                if event.content or event.tool_calls:  # held back while it could have been a tool call
                    text, calls = _calls_apart(event.content or "", event.tool_calls)
                    yield _line(_piece(info, chat, text, tool_calls=calls))
                yield _line(_piece(info, chat, "", done=True, **_final_fields(started, event, t0)))
                return
    except APIError as e:  # after the 200 went out, an error is a line of its own
        yield _line({"error": e.message})
    except ClientGone:
        return
    finally:
        events.job.cancel.set()


def _line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


# ---------------------------------------------------------------------------------------------
# The model, as Ollama lists and shows it


def _details(info: ModelInfo) -> dict:
    quant = _QUANT.search(info.file_name.removesuffix(".gguf"))
    return {"parent_model": "", "format": "gguf", "family": info.architecture, "families": [info.architecture],
            "parameter_size": info.size_label, "quantization_level": quant.group(1).upper() if quant else ""}


def _listing(info: ModelInfo) -> dict:
    return {"name": info.target, "model": info.target, "modified_at": _modified(info), "size": info.file_bytes,
            "digest": "", "details": _details(info)}


def _show(info: ModelInfo) -> dict:
    capabilities = ["completion"]
    if tool_format(info.chat_template) is not None:
        capabilities.append("tools")
    if reasoning.template_syntax(info.chat_template):
        capabilities.append("thinking")
    model_info = {"general.architecture": info.architecture}
    if info.n_ctx_train:
        model_info[f"{info.architecture}.context_length"] = info.n_ctx_train
    return {
        "modelfile": "", "parameters": f"num_ctx {info.n_ctx}", "template": info.chat_template or "",
        "details": _details(info), "model_info": model_info, "capabilities": capabilities,
        "modified_at": _modified(info),
    }
