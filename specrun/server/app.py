"""The HTTP routes: /health, /v1/models, /v1/chat/completions, /v1/completions.

Routes validate a request, hand it to the generation worker as a Job and turn the worker's events
into a JSON answer or a server-sent-event stream. The worker reads the job's prompt when it
arrives, so a prompt that does not fit the context is a 400 at once, before it waits for its turn;
the rest of a response's status is decided when the turn comes, so even a streamed request gets a
proper 400 for a grammar whose first step fails.
Every error, including a bug, is answered as a JSON error in the shape of the route's API
(OpenAI's, or Ollama's under /api/); the server keeps serving. An error after a stream began
(a grammar llguidance gives up on mid-answer) is the stream's last event.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specrun.engine.grammar import schema_grammar, text_grammar
from specrun.errors import UsageError
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
from specrun.server.ollama import add_ollama_routes
from specrun.server.requestlog import RequestLog
from specrun.server.responses import DONE, Envelope, sse
from specrun.server.schemas import (
    DEFAULT_TEMPERATURE,
    APIError,
    ChatRequest,
    CompletionRequest,
    Constraint,
    GenerationRequest,
    parse_body,
    refuse_unsupported,
)
from specrun.server.sites import SiteGuard
from specrun.server.worker import QueueWorker

log = logging.getLogger("specrun.server")

# Requests are JSON: a long conversation is well under this; anything larger is refused (413)
# before it is read into memory.
MAX_BODY_BYTES = 1 << 20


# Response headers a browser page may read.
EXPOSED_HEADERS = ["X-Request-Id", "X-Queue-Position", "X-Specrun-Max-Tokens"]
# Routes answered without the API key: liveness checks carry no model output.
OPEN_PATHS = frozenset({"/health"})


@dataclass(frozen=True)
class ServerSettings:
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = MAX_BODY_BYTES
    verbose: bool = False  # log refused requests' bodies too
    # Host names (besides localhost, this machine's name and any address) requests may be sent to.
    allowed_hosts: tuple[str, ...] = ()
    # Seconds a client has to send a whole request (see server.connections).
    read_timeout_s: float = 30.0
    # serve --reproducible: every request is decoded as a --reproducible one (the worker pins it).
    reproducible: bool = False


def create_app(worker: QueueWorker, settings: ServerSettings) -> FastAPI:
    """Return the ASGI app serving `worker`'s model."""
    app = FastAPI(title="specrun", docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app)
    _add_routes(app, worker)
    add_ollama_routes(app, worker)
    app.add_middleware(RequestGuard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(SiteGuard, cors_origins=settings.cors_origins, allowed_hosts=settings.allowed_hosts,
                       check_host=settings.api_key is None)
    if settings.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        # Added last, so it is the outermost layer: preflight requests never need the API key.
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["Authorization", "Content-Type"],
                           expose_headers=EXPOSED_HEADERS)
    # Outermost: every response, refusals by the layers above included, carries the request id.
    app.add_middleware(RequestLog, verbose=settings.verbose)
    return app


# ---------------------------------------------------------------------------------------------
# Errors


def error_response(error: APIError, path: str = "") -> JSONResponse:
    """Return the error as the API of `path` writes it: Ollama's under /api/, OpenAI's elsewhere."""
    body = {"error": error.message} if path.startswith("/api/") else error.body()
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            error = APIError(404, f"no such route: {request.method} {request.url.path}", code="not_found")
        elif exc.status_code == 405:
            error = APIError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")
        else:
            error = APIError(exc.status_code, str(exc.detail))
        return error_response(error, request.url.path)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback on stderr after this answer; the client only hears that it happened.
        error = APIError(500, f"internal error ({type(exc).__name__}); the server logged it")
        return error_response(error, request.url.path)


class RequestGuard:
    """ASGI middleware run before any route: the API key (on every route but /health), and the body size limit."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await error_response(refusal, scope["path"])(scope, receive, send)
            return
        await self.app(scope, self._limited(receive), send)

    def _refusal(self, scope) -> APIError | None:
        headers = dict(scope.get("headers") or ())
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            if not self._key_matches(headers.get(b"authorization", b"")):
                return APIError(401, "missing or wrong API key: send the header Authorization: Bearer <key>",
                                param=None, code="invalid_api_key")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return self._too_large()
        return None

    def _key_matches(self, authorization: bytes) -> bool:
        scheme, _, key = authorization.partition(b" ")
        # compare_digest: the time taken does not tell how much of a wrong key was right.
        return hmac.compare_digest(key.strip(), self.api_key) and scheme.lower() == b"bearer"

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_body_bytes} bytes", code="request_too_large")

    def _limited(self, receive):
        """Return receive() that refuses a body (sent without Content-Length) once it grows too large."""
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise self._too_large()
            return message

        return limited_receive


# ---------------------------------------------------------------------------------------------
# Routes


async def _answers_memory(worker: QueueWorker) -> dict | None:
    """The memory of earlier answers (decoding.memory) as it stands: answers, tokens and bytes
    kept; where the runtime lives in another process (--rpc), as that process says (None where
    it does not answer: lost, loading again)."""
    ask = getattr(worker, "answers_memory", None)
    if ask is not None:
        return await asyncio.to_thread(ask)
    memory = getattr(getattr(worker, "runtime", None), "memory", None)
    return memory.stats() if memory is not None else None


def _add_routes(app: FastAPI, worker: QueueWorker) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        if worker.state == "ready" and not worker.alive:
            return JSONResponse({"status": "worker stopped"}, status_code=503)
        if worker.state == "ready":
            return JSONResponse({"status": "ok", "queued": worker.queued})
        return JSONResponse({"status": worker.state}, status_code=503)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        info = worker.ready_model()
        # context_length (OpenRouter, LM Studio) and max_model_len (vLLM) are where clients look
        # for the context size; meta.n_ctx_train as llama.cpp's server names it.
        entry = {"id": info.target, "object": "model", "created": 0, "owned_by": "specrun",
                 "context_length": info.n_ctx, "max_model_len": info.n_ctx,
                 "meta": {"draft": info.draft, "drafter": info.drafter, "n_ctx": info.n_ctx,
                          "n_ctx_train": info.n_ctx_train, "tree_budget": info.tree_budget,
                          "reproducible": worker.reproducible,  # serve --reproducible: every request
                          "throughput": info.throughput,  # serve --throughput (with --parallel N > 1)
                          "answers_memory": await _answers_memory(worker)}}
        return JSONResponse({"object": "list", "data": [entry]})

    @app.get("/props")
    async def props() -> JSONResponse:
        # The shape of llama.cpp's server /props, which llama.cpp's web UI and some clients read.
        info = worker.ready_model()
        return JSONResponse({
            "default_generation_settings": {"n_ctx": info.n_ctx, "model": info.target,
                                            "params": {"temperature": DEFAULT_TEMPERATURE}},
            "total_slots": 1, "model_alias": info.target, "model_path": info.file_name,
            "chat_template": info.chat_template or "", "n_ctx_train": info.n_ctx_train,
        })

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _parse(request, ChatRequest)
        envelope = Envelope(worker.ready_model().target, chat=True)
        prompt = chat_prompt(body)
        constraint = checked_constraint(body)
        _refuse_grammar_beside_tools(prompt, constraint)
        return await _answer(request, worker, body, prompt, envelope, constraint)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionRequest)
        if isinstance(body.prompt, str):
            prompt = TextPrompt(text=body.prompt, parse_special=body.parse_special)
        else:
            prompt = TextPrompt(token_ids=body.prompt)
        envelope = Envelope(worker.ready_model().target, chat=False)
        return await _answer(request, worker, body, prompt, envelope, checked_constraint(body))


def chat_prompt(body: ChatRequest) -> ChatPrompt:
    """Return the conversation to render, with its tools and what tool_choice asks."""
    messages = body.template_messages()
    if not body.tools:
        if body.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice", code="invalid_value")
        return ChatPrompt(messages, body.chat_template_kwargs, body.reasoning_format)
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    return ChatPrompt(messages, body.chat_template_kwargs, body.reasoning_format, tools,
                      _tool_choice(body.tool_choice, {t["function"]["name"] for t in tools}))


def _tool_choice(choice, names: set[str]) -> str:
    """Return tool_choice as auto, none, required or function:NAME; a 400 for anything else."""
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return choice
    name = None
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise APIError(400, 'tool_choice must be "auto", "none", "required" or {"type": "function", '
                       '"function": {"name": ...}}', param="tool_choice", code="invalid_value")
    if name not in names:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice",
                       code="invalid_value")
    return f"function:{name}"


def checked_constraint(body: GenerationRequest) -> Constraint | None:
    """Return what the answer must follow, or raise a 400 naming what cannot be compiled in it."""
    constraint = body.constraint()
    try:
        if constraint is not None and constraint.schema is not None:
            schema_grammar(constraint.schema)
        elif constraint is not None:
            text_grammar(constraint.grammar)
    except UsageError as e:
        raise APIError(400, str(e), param=constraint.field, code="invalid_value") from None
    return constraint


def _refuse_grammar_beside_tools(prompt: ChatPrompt, constraint: Constraint | None) -> None:
    """Raise a 400 for a grammar of the client's own beside tools the model may call: it leaves no
    room for a call (a JSON schema does: the answer is then the call or the JSON)."""
    if constraint is not None and constraint.grammar is not None and prompt.tools and prompt.tool_choice != "none":
        raise APIError(400, "grammar cannot be combined with tools the model may call (send tool_choice none, "
                       "or a JSON schema in response_format)", param="grammar", code="invalid_value")


async def _parse(request: Request, model: type[GenerationRequest]) -> GenerationRequest:
    """Return the validated body. Parsed here rather than by FastAPI so that any content type
    works (curl -d sends form encoding) and every problem gets the same OpenAI-shaped 400."""
    body = parse_body(await request.body(), model)
    refuse_unsupported(body)
    return body


async def _answer(request: Request, worker: QueueWorker, body: GenerationRequest, prompt, envelope: Envelope,
                  constraint: Constraint | None) -> Response:
    field = {} if constraint is None else {"constraint_field": constraint.field}
    job = Job(envelope.id, prompt, body.request(constraint), asyncio.get_running_loop(), **field)
    await worker.admit(job)  # its prompt read and checked now; a 400 or 503 raises here
    events = EventReader(request, job)
    try:
        started = await events.next()  # waits for the job's turn; a grammar that cannot start raises here
    except ClientGone:
        raise disconnected() from None  # nobody reads it: the status and reason are for the log
    headers = _limit_headers(started)
    headers["X-Queue-Position"] = str(job.ahead)
    if body.streaming:
        headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return StreamingResponse(_stream(events, started, envelope, body.include_usage),
                                 media_type="text/event-stream", headers=headers)
    try:
        answer = await events.rest(logprobs=job.request.logprobs is not None)
    except ClientGone:
        raise disconnected() from None
    finished = answer.finished
    whole = envelope.whole(answer.text, finished.finish_reason, started, finished.n_generated, finished.stats,
                           reasoning=answer.reasoning, logprobs=answer.logprobs, tool_calls=finished.tool_calls)
    return JSONResponse(whole, headers=headers)


def _limit_headers(started: Started) -> dict[str, str]:
    """Say how many tokens the answer may have, and the client's own limit when the context lowered it."""
    headers = {"X-Specrun-Max-Tokens": str(started.max_tokens)}
    if started.capped:
        headers["X-Specrun-Max-Tokens-Capped"] = str(started.requested_max_tokens)
    return headers


async def _stream(events: EventReader, started: Started, envelope: Envelope, include_usage: bool):
    """Yield the answer as server-sent events, ending with data: [DONE]."""
    try:
        if envelope.chat:
            yield sse(envelope.chunk(role=True))
        while True:
            event = await events.next()
            if isinstance(event, Piece):
                yield sse(envelope.chunk(text=event.text, reasoning=event.reasoning, logprobs=event.logprobs))
            elif isinstance(event, Finished):
                if event.content:  # held back while it could have been a tool call
                    yield sse(envelope.chunk(text=event.content))
                for i, call in enumerate(event.tool_calls or ()):
                    for delta in envelope.tool_call_deltas(i, call):
                        yield sse(delta)
                yield sse(envelope.final_chunk(event.finish_reason, started, event.stats))
                if include_usage:
                    yield sse(envelope.usage_chunk(started, event.n_generated, event.stats))
                yield DONE
                return
    except APIError as e:  # after the 200 went out, an error can only be an event of its own
        yield sse(e.body())
        yield DONE
    except ClientGone:
        return
    finally:
        # Also reached when Starlette cancels the stream because the client disconnected.
        events.job.cancel.set()
