"""Request bodies of the OpenAI API as pydantic models, and OpenAI-shaped errors.

Unknown fields are ignored: clients send many that do not matter here. Fields whose value would
change the answer in a way specrun cannot honour (n > 1, tools, log-probabilities, penalties) are
refused with a 400 that says so rather than silently dropped (`refuse_unsupported`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specrun.core.sampling import SamplingParams
from specrun.errors import UsageError

# What an absent sampling field means. Temperature 1 is the OpenAI API's documented default (the
# CLI's greedy default would surprise API clients, which send a temperature when they want one).
DEFAULT_TEMPERATURE = 1.0

ROLES = ("system", "user", "assistant")
# Newer OpenAI clients send "developer" where older ones sent "system"; the templates know only
# the latter.
ROLE_ALIASES = {"developer": "system"}


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    """Return the JSON body every error has, as the OpenAI API writes it."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error(errors: list[dict]) -> APIError:
    """Return a 400 describing the first problem pydantic (or the JSON parser) found in a body."""
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON{f' ({detail})' if detail else ''}", code="invalid_json")
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if not loc and first.get("type") == "missing":
        return APIError(400, "the request needs a JSON object as its body", code="invalid_body")
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    where = _dotted(loc)
    return APIError(400, f"{where}: {message}" if where else message, param=str(loc[0]) if loc else None,
                    code="invalid_value")


def _dotted(loc: list) -> str:
    """Return a location like messages[0].role from pydantic's ('messages', 0, 'role')."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


# ---------------------------------------------------------------------------------------------
# Bodies


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


def _text_of(content: Any, required: bool) -> str:
    """Return the text of a message content: a string, or an array of {"type": "text", "text"} parts."""
    if content is None:
        if required:
            raise ValueError("content is required")
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("content must be a string or an array of text parts")
    texts = []
    for part in content:
        if not isinstance(part, dict) or not isinstance(part.get("text"), str) or part.get("type", "text") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"only text content parts are supported, got {kind!r}")
        texts.append(part["text"])
    return "".join(texts)


class Message(BaseModel):
    """One chat message; `content` is kept as sent and flattened by `as_template_message`."""

    model_config = ConfigDict(extra="ignore")

    role: str
    content: Any = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        role = ROLE_ALIASES.get(role, role)
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}: use system, user or assistant")
        return role

    @field_validator("content")
    @classmethod
    def _text_content(cls, content: Any, info) -> str:
        # An assistant turn that only called tools has no content; every other turn needs text.
        return _text_of(content, required=info.data.get("role") != "assistant")

    def as_template_message(self) -> dict:
        return {"role": self.role, "content": self.content}


class GenerationRequest(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = None
    stop: Any = Field(default=None, validate_default=True)
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Accepted only at their neutral values (see refuse_unsupported).
    logprobs: Any = None
    top_logprobs: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    tools: Any = None
    functions: Any = None
    response_format: Any = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise ValueError("only n=1 is supported: specrun writes one choice per request")
        return n

    @field_validator("seed")
    @classmethod
    def _seed(cls, seed: int | None) -> int | None:
        if seed is None or seed == -1:  # llama.cpp's server reads -1 as "a fresh random seed"
            return None
        if seed < 0:
            raise ValueError("seed must be a whole number >= 0 (or -1 for a random one)")
        return seed

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: Any) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            return (stop,)
        if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 16:
            return tuple(stop)
        raise ValueError("stop must be a string or an array of at most 16 strings")

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def token_limit(self) -> int | None:
        """Return the requested maximum of generated tokens (None: until the context is full)."""
        return self.max_tokens

    def sampling(self) -> SamplingParams:
        """Return the sampling settings, or raise a 400 naming the bad one."""
        temperature = DEFAULT_TEMPERATURE if self.temperature is None else self.temperature
        try:
            return SamplingParams(temperature, self.top_k or 0, 1.0 if self.top_p is None else self.top_p,
                                  self.min_p or 0.0, self.seed)
        except UsageError as e:
            raise APIError(400, str(e), code="invalid_value") from None


class ChatRequest(GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict]:
        return [m.as_template_message() for m in self.messages]


class CompletionRequest(GenerationRequest):
    prompt: Any
    # Special-token text in a raw prompt becomes special tokens, as in llama.cpp's server; false: plain text.
    parse_special: bool = True
    echo: Any = None
    suffix: Any = None
    best_of: Any = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        """Return the prompt as text, or as token ids when the client sent ids."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            return prompt
        raise ValueError("prompt must be one string or one array of token ids (batches are not supported)")


# Fields a client may send only at a value that changes nothing: (field, neutral values, what).
_UNSUPPORTED = (
    ("logprobs", (None, False, 0), "log-probabilities are"),
    ("top_logprobs", (None, 0), "log-probabilities are"),
    ("presence_penalty", (None, 0), "presence_penalty is"),
    ("frequency_penalty", (None, 0), "frequency_penalty is"),
    ("logit_bias", (None, {}), "logit_bias is"),
    ("tools", (None, []), "tools are"),
    ("functions", (None, []), "function calling is"),
    ("response_format", (None, {"type": "text"}), "response_format other than text is"),
    ("echo", (None, False), "echo is"),
    ("suffix", (None, ""), "suffix is"),
    ("best_of", (None, 1), "best_of is"),
)


def refuse_unsupported(request: GenerationRequest) -> None:
    """Raise a 400 when the request asks for something specrun does not do."""
    for name, neutral, what in _UNSUPPORTED:
        value = getattr(request, name, None)
        if not any(_same(value, n) for n in neutral):
            raise APIError(400, f"{what} not supported by specrun", param=name, code="unsupported_parameter")


def _same(value: Any, neutral: Any) -> bool:
    # Booleans by identity: True == 1 would let logprobs=true pass as a neutral 1.
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return value == neutral
