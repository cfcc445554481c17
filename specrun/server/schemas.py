"""Request bodies of the OpenAI API as pydantic models, and OpenAI-shaped errors.

Unknown fields are ignored: clients send many that do not matter here. Fields whose value would
change the answer in a way specrun cannot honour (n > 1, echo, suffix, best_of, legacy
`functions`) are refused with a 400 that says so rather than silently dropped
(`refuse_unsupported`). Log-probabilities, penalties, logit_bias, response_format (and llama.cpp's
server's `json_schema` and `grammar` fields) and tools are served, exactly under speculation.
specrun's own `reproducible` asks for the same answer whatever else runs (SamplingParams.reproducible).
Boolean fields take JSON's true and false only (StrictBool), as the OpenAI API does: pydantic's
lax mode would read "yes", "false", 1 or "off" as booleans.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator

from specrun.chat import reasoning
from specrun.core.sampling import MAX_TOP_LOGPROBS
from specrun.errors import UsageError
from specrun.inputs import token_id
from specrun.runtime.request import Request

# What an absent sampling field means. Temperature 1 is the OpenAI API's documented default (the
# CLI's greedy default would surprise API clients, which send a temperature when they want one).
DEFAULT_TEMPERATURE = 1.0

ROLES = ("system", "user", "assistant", "tool")
# Template variables the server itself fills in; chat_template_kwargs may not replace them.
TEMPLATE_RESERVED = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})
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

    def __reduce__(self):
        # Pickled whole (server.isolated sends errors between processes), keyword fields included.
        return _api_error, (self.status, self.message, self.type, self.param, self.code, self.headers)


def _api_error(status, message, type, param, code, headers) -> APIError:
    return APIError(status, message, type=type, param=param, code=code, headers=headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    """Return the JSON body every error has, as the OpenAI API writes it."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# A \uD800-\uDFFF escape not part of a high-low pair: JSON allows writing it, but it is no character.
_LONE_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                             rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def validation_error(errors: list[dict]) -> APIError:
    """Return a 400 describing the first problem pydantic (or the JSON parser) found in a body."""
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        surrogate = _LONE_SURROGATE.search(first.get("input") or b"") if "escape" in detail else None
        if surrogate:
            detail = (f"{surrogate.group().decode()} is half of a UTF-16 surrogate pair, not a character: "
                      "send the text as UTF-8, or the escape of a whole pair")
        return APIError(400, f"the request body is not valid JSON{f' ({detail})' if detail else ''}", code="invalid_json")
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if not loc and first.get("type") == "missing":
        return APIError(400, "the request needs a JSON object as its body", code="invalid_body")
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "bool_type":  # a StrictBool given anything but true or false
        message = f"must be true or false, got {_json_excerpt(first.get('input'))}"
    where = _dotted(loc)
    return APIError(400, f"{where}: {message}" if where else message, param=str(loc[0]) if loc else None,
                    code="invalid_value")


def _json_excerpt(value: Any) -> str:
    """Return a value as JSON writes it, cut short for an error message."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Return the validated body, or raise a 400 that names the first problem."""
    if not raw.strip():
        raise APIError(400, "the request needs a JSON object as its body", code="invalid_body")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


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

    include_usage: StrictBool = False


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
    # An assistant turn's thinking, as servers answer it and Open WebUI sends it back.
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls, sent back in the history
    tool_call_id: str | None = None  # a tool result: the call it answers
    name: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        role = ROLE_ALIASES.get(role, role)
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}: use system, user, assistant or tool")
        return role

    @field_validator("content")
    @classmethod
    def _text_content(cls, content: Any, info) -> str:
        # An assistant turn that only called tools has no content; every other turn needs text.
        return _text_of(content, required=info.data.get("role") != "assistant")

    def as_template_message(self) -> dict:
        message: dict = {"role": self.role, "content": self.content}
        if self.tool_calls:
            # Templates read arguments as an object (HF's convention); the API sends JSON text.
            message["tool_calls"] = [call.as_template_call() for call in self.tool_calls]
        if self.reasoning_content and self.role == "assistant":
            # Qwen3-style templates read reasoning_content, gpt-oss's reads thinking.
            message["reasoning_content"] = message["thinking"] = self.reasoning_content
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


class Function(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str = "function"
    function: Function

    @field_validator("type")
    @classmethod
    def _function(cls, kind: str) -> str:
        if kind != "function":
            raise ValueError(f"only function tools are supported, got {kind!r}")
        return kind


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: Any = "{}"

    @field_validator("arguments")
    @classmethod
    def _json_arguments(cls, arguments: Any) -> Any:
        """Return the arguments as an object: templates read them so (Hugging Face's convention),
        while the OpenAI API sends them as JSON text."""
        if not isinstance(arguments, str):
            return arguments
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise ValueError("arguments must be JSON (an object of the call's arguments)") from None
        except RecursionError:
            raise ValueError("arguments are nested too deeply") from None


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: str = "function"
    function: CalledFunction

    def as_template_call(self) -> dict:
        call = {"type": "function", "function": {"name": self.function.name, "arguments": self.function.arguments}}
        if self.id is not None:
            call["id"] = self.id
        return call


Message.model_rebuild()


def checked(request: Request, param: str | None = None) -> Request:
    """Return the request, or raise a 400 naming its bad sampling setting (`param`: the field that
    holds them all, where the API nests them)."""
    try:
        request.sampling()
    except UsageError as e:
        raise APIError(400, str(e), param=param, code="invalid_value") from None
    return request


@dataclass(frozen=True)
class Constraint:
    """What the answer must follow (besides a forced tool call), and the request field that asked."""

    field: str  # response_format, json_schema or grammar: named in errors
    schema: dict | None = None  # a JSON schema the answer is valid under, or
    grammar: str | None = None  # a GBNF (llama.cpp) or Lark grammar it follows


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
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None  # chat: true/false; completions: how many alternatives
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repeat_penalty: float | None = Field(default=None, gt=0)  # llama.cpp's server's field
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # llama.cpp's server's fields for a constrained answer: a JSON schema, or a GBNF (or Lark) grammar.
    json_schema: dict | None = None
    grammar: str | None = None
    # specrun's own: the same answer whatever else runs (generate --reproducible; serve --reproducible
    # makes every request so, whatever this says).
    reproducible: StrictBool = False
    # Accepted only at their neutral values (see refuse_unsupported).
    functions: Any = None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if token_id(key) is None:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {key}")
        return bias

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise ValueError("only n=1 is supported: specrun writes one choice per request; for several "
                             "candidates send the request several times (with different seeds)")
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

    def n_logprobs(self) -> int | None:
        """Return how many alternatives to report per token (None: no log-probs)."""
        if self.logprobs is None or self.logprobs is False:
            return None
        if self.logprobs is True:
            return self.top_logprobs or 0
        if not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="logprobs", code="invalid_value")
        return self.logprobs

    def request(self, constraint: Constraint | None) -> Request:
        """Return the generation request these fields ask for (the answer following `constraint`),
        or raise a 400 naming a bad setting."""
        bias = tuple((token_id(k), float(v)) for k, v in (self.logit_bias or {}).items())
        schema = None if constraint is None or constraint.schema is None else json.dumps(constraint.schema)
        request = Request(
            max_tokens=self.token_limit(), stop=self.stop,
            temperature=DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            top_k=self.top_k or 0, top_p=1.0 if self.top_p is None else self.top_p, min_p=self.min_p or 0.0,
            seed=self.seed, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repeat_penalty=1.0 if self.repeat_penalty is None else self.repeat_penalty, logit_bias=bias,
            logprobs=self.n_logprobs(), json_schema=schema, grammar=None if constraint is None else constraint.grammar,
            reproducible=self.reproducible)
        return checked(request)

    def constraint(self) -> Constraint | None:
        """Return what the answer must follow (None: free text), or raise a 400 when more than one
        field asks."""
        schema = None if self.response_format is None else self.response_format.answer_schema()
        given = [Constraint("response_format", schema=schema)] if schema is not None else []
        if self.json_schema is not None:
            given.append(Constraint("json_schema", schema=self.json_schema))
        if self.grammar is not None:
            given.append(Constraint("grammar", grammar=self.grammar))
        if len(given) > 1:
            raise APIError(400, f"{' and '.join(c.field for c in given)} both shape the answer: give one of them",
                           param=given[1].field, code="invalid_value")
        return given[0] if given else None


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """response_format: text, json_object (any object; llama.cpp's server also reads a `schema`
    there), or json_schema."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: str
    json_schema: JSONSchemaFormat | None = None
    schema_: dict | None = Field(default=None, alias="schema")

    @field_validator("type")
    @classmethod
    def _kind(cls, kind: str) -> str:
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")
        return kind

    def answer_schema(self) -> dict | None:
        """Return the schema the answer must satisfy (None: free text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return self.schema_ or {"type": "object"}
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format",
                           code="invalid_value")
        return self.json_schema.schema_


GenerationRequest.model_rebuild()


class ChatRequest(GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # Where thinking goes: auto (reasoning_content) or none (left in content); None: the server's.
    reasoning_format: str | None = None
    # Extra variables for the chat template, e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, validate_default=True)  # None becomes {}

    @field_validator("reasoning_format")
    @classmethod
    def _reasoning_format(cls, name: str | None) -> str | None:
        return None if name is None else reasoning.normalize_format(name)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any]:
        kwargs = kwargs or {}
        reserved = sorted(set(kwargs) & TEMPLATE_RESERVED)
        if reserved:
            raise ValueError(f"{', '.join(reserved)} cannot be set here: the server sets it")
        return kwargs
    tools: list[Tool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None

    @field_validator("logprobs", mode="before")  # before: the lax bool would read "true" or "yes" as true
    @classmethod
    def _chat_logprobs(cls, logprobs):
        if logprobs is not None and not isinstance(logprobs, bool):
            raise ValueError("must be true or false (top_logprobs says how many alternatives)")
        return logprobs

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict]:
        return [m.as_template_message() for m in self.messages]


class CompletionRequest(GenerationRequest):
    prompt: Any
    # Special-token text in a raw prompt becomes special tokens, as in llama.cpp's server; false: plain text.
    parse_special: StrictBool = True
    echo: Any = None
    suffix: Any = None
    best_of: Any = None

    @field_validator("logprobs", mode="before")  # before: the lax bool would read "true" or "yes" as true
    @classmethod
    def _completion_logprobs(cls, logprobs):
        if logprobs is not None and not isinstance(logprobs, (bool, int)):
            raise ValueError("must be how many alternatives to report (a whole number)")
        return logprobs

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
    ("functions", (None, []), "legacy function calling (functions) is; send tools, and it"),
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
