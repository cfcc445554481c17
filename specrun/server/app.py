"""The HTTP routes: /health, /v1/models, /v1/chat/completions, /v1/completions.

Routes validate a request, hand it to the generation worker as a Job and turn the worker's events
into a JSON answer or a server-sent-event stream. A response's status is decided when the job's
turn comes (its prompt is tokenized and checked against the context then), so even a streamed
request gets a proper 400 for a prompt that does not fit. Every error, including a bug, is
answered as an OpenAI-shaped JSON error; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specrun.server.jobs import (
    ChatPrompt,
    Failed,
    Finished,
    Job,
    Piece,
    Started,
    TextPrompt,
)
from specrun.server.responses import DONE, Envelope, sse
from specrun.server.schemas import (
    APIError,
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    error_body,
    refuse_unsupported,
    validation_error,
)
from specrun.server.worker import POLL_S, GenerationWorker

log = logging.getLogger("specrun.server")

# Requests are JSON: a long conversation is well under this; anything larger is refused (413)
# before it is read into memory.
MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True)
class ServerSettings:
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = MAX_BODY_BYTES


def create_app(worker: GenerationWorker, settings: ServerSettings) -> FastAPI:
    """Return the ASGI app serving `worker`'s model."""
    app = FastAPI(title="specrun", docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app)
    _add_routes(app, worker)
    app.add_middleware(RequestGuard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)
    if settings.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        # Added last, so it is the outermost layer: preflight requests never need the API key.
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["Authorization", "Content-Type"])
    return app


# ---------------------------------------------------------------------------------------------
# Errors


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            error = APIError(404, f"no such route: {request.method} {request.url.path}", code="not_found")
        elif exc.status_code == 405:
            error = APIError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")
        else:
            error = APIError(exc.status_code, str(exc.detail))
        return error_response(error)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback on stderr after this answer; the client only hears that it happened.
        return JSONResponse(error_body(f"internal error ({type(exc).__name__}); the server logged it", "server_error"),
                            status_code=500)


class RequestGuard:
    """ASGI middleware run before any route: the API key on /v1 routes, and the body size limit."""

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
            await error_response(refusal)(scope, receive, send)
            return
        await self.app(scope, self._limited(receive), send)

    def _refusal(self, scope) -> APIError | None:
        headers = dict(scope.get("headers") or ())
        if self.api_key is not None and scope["path"].startswith("/v1"):
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


def _add_routes(app: FastAPI, worker: GenerationWorker) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        if worker.state == "ready":
            return JSONResponse({"status": "ok", "queued": worker.queued})
        return JSONResponse({"status": worker.state}, status_code=503)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        info = _ready_model(worker)
        entry = {"id": info.target, "object": "model", "created": 0, "owned_by": "specrun",
                 "meta": {"draft": info.draft, "drafter": info.drafter, "n_ctx": info.n_ctx,
                          "tree_budget": info.tree_budget}}
        return JSONResponse({"object": "list", "data": [entry]})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _parse(request, ChatRequest)
        envelope = Envelope(_ready_model(worker).target, chat=True)
        return await _answer(request, worker, body, ChatPrompt(body.template_messages()), envelope)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionRequest)
        if isinstance(body.prompt, str):
            prompt = TextPrompt(text=body.prompt, parse_special=body.parse_special)
        else:
            prompt = TextPrompt(token_ids=body.prompt)
        envelope = Envelope(_ready_model(worker).target, chat=False)
        return await _answer(request, worker, body, prompt, envelope)


def _ready_model(worker: GenerationWorker):
    if worker.model is None or worker.state == "loading":
        raise APIError(503, "the model is still loading", code="model_loading", headers={"Retry-After": "5"})
    return worker.model


async def _parse(request: Request, model: type[GenerationRequest]) -> GenerationRequest:
    """Return the validated body. Parsed here rather than by FastAPI so that any content type
    works (curl -d sends form encoding) and every problem gets the same OpenAI-shaped 400."""
    raw = await request.body()
    if not raw.strip():
        raise APIError(400, "the request needs a JSON object as its body", code="invalid_body")
    try:
        body = model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None
    refuse_unsupported(body)
    return body


async def _answer(request: Request, worker: GenerationWorker, body: GenerationRequest, prompt, envelope: Envelope) -> Response:
    job = Job(envelope.id, prompt, body.sampling(), body.token_limit(), body.stop, asyncio.get_running_loop())
    worker.submit(job)
    events = EventReader(request, job)
    try:
        started = await events.next()  # waits for the job's turn; an unusable prompt raises here
    except ClientGone:
        return Response(status_code=499)  # nobody reads it
    headers = _limit_headers(started)
    if body.streaming:
        headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return StreamingResponse(_stream(events, started, envelope, body.include_usage),
                                 media_type="text/event-stream", headers=headers)
    parts: list[str] = []
    try:
        while True:
            event = await events.next()
            if isinstance(event, Piece):
                parts.append(event.text)
            elif isinstance(event, Finished):
                break
    except ClientGone:
        return Response(status_code=499)
    finally:
        job.cancel.set()  # a no-op once finished; stops the worker when this coroutine is cancelled
    return JSONResponse(envelope.whole("".join(parts), event.finish_reason, started, event.n_generated, event.stats),
                        headers=headers)


def _limit_headers(started: Started) -> dict[str, str]:
    """Say how many tokens the answer may have, and the client's own limit when the context lowered it."""
    headers = {"X-Specrun-Max-Tokens": str(started.max_tokens)}
    if started.capped:
        headers["X-Specrun-Max-Tokens-Capped"] = str(started.requested_max_tokens)
    return headers


async def _stream(events: "EventReader", started: Started, envelope: Envelope, include_usage: bool):
    """Yield the answer as server-sent events, ending with data: [DONE]."""
    try:
        if envelope.chat:
            yield sse(envelope.chunk(role=True))
        while True:
            event = await events.next()
            if isinstance(event, Piece):
                yield sse(envelope.chunk(text=event.text))
            elif isinstance(event, Finished):
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


class ClientGone(Exception):
    """The client disconnected; its job has been cancelled."""


class EventReader:
    """Reads a job's events, watching for the client going away while it waits."""

    def __init__(self, request: Request, job: Job):
        self.request = request
        self.job = job
        self._getter: asyncio.Task | None = None

    async def next(self) -> Started | Piece | Finished:
        """Return the next event; raise a Failed event's error, or ClientGone."""
        # One pending get() survives the polls, so an event can never be lost to a timeout.
        if self._getter is None:
            self._getter = asyncio.ensure_future(self.job.events.get())
        try:
            while True:
                done, _ = await asyncio.wait({self._getter}, timeout=POLL_S)
                if done:
                    break
                if await self.request.is_disconnected():
                    self.job.cancel.set()
                    raise ClientGone()
        except BaseException:
            self._getter.cancel()
            self._getter = None
            raise
        event, self._getter = self._getter.result(), None
        if isinstance(event, Failed):
            raise event.error
        return event
