"""Tool calls in each template family's own format: which one a template speaks, the grammar that
forces a call (tool_choice required or named), and parsing a model's answer into OpenAI calls.

Tools reach the model through its own chat template (the `tools` variable, as Hugging Face
renders it); what differs between families is how the model writes a call:

| family | a call as the model writes it |
|---|---|
| hermes (Qwen 2.5/3, Hermes, SmolLM3, ...) | `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` |
| llama3 (Llama 3.1-3.3) | `{"name": ..., "parameters": {...}}` |
| mistral (Nemo, Small 3.x, Devstral) | `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` or `[TOOL_CALLS]name[ARGS]{...}` |
| harmony (gpt-oss) | `<\\|channel\\|>commentary to=functions.NAME <\\|constrain\\|>json<\\|message\\|>{...}` |
| gemma4 | `<\\|tool_call>call:NAME{key:value,...}<tool_call\\|>` |

Grammars are llguidance Lark: a marker that is one special token of the vocabulary is written as
that token (`<[id]>`), anything else as text; arguments are `%json` sub-grammars of each tool's
parameter schema. A forced call starts at the first generated token. A parameter schema placed
inside a larger one (the call object) has its local `$ref`s rewritten to point where it now lies,
so the `$defs` of nested models (pydantic's) still resolve.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field, replace

from specrun.engine.grammar import JSON_OPTIONS
from specrun.errors import UsageError


def _call_id() -> str:
    # Nine letters and digits: Mistral's templates refuse any other id when the call comes back.
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as the OpenAI API sends it
    id: str = field(default_factory=_call_id)


@dataclass(frozen=True)
class ToolFormat:
    """How one template family writes tool calls."""

    family: str
    detect: tuple[str, ...]  # all of these in a template mean this family
    thinks: bool = False  # the template has the model think first (<think>...</think>)

    def grammar(self, tools: list[dict], marker) -> str:
        """Return a Lark grammar for exactly one call of one of `tools` (OpenAI function dicts),
        after a finished thinking block where the template has one.

        `marker(text)` returns the Lark literal for a fixed piece of text (a special token or a string).
        """
        grammar = _GRAMMARS[self.family](tools, marker)
        if not self.thinks:
            return grammar.replace("start: think? ", "start: ")
        return grammar + _thinking(marker) if "start: think? " in grammar else grammar

    def call_or_answer(self, tools: list[dict], marker, schema: dict) -> str:
        """Return a Lark grammar for one call of one of `tools`, or instead an answer that is JSON
        valid under `schema` (tools the model may call, and response_format)."""
        call = self.grammar(tools, marker).replace("start:", "tool_call:", 1)
        answer = {**schema, "x-guidance": JSON_OPTIONS}  # laid out as response_format alone lays it out
        return f"start: tool_call | json_answer\njson_answer: %json {_schema_json(answer)}\n{call}"

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """Return (content without the calls, the calls) from a model's answer (special tokens kept)."""
        return _PARSERS[self.family](text)


# First match wins: every marker of `detect` must be in the template.
FORMATS = (
    ToolFormat("harmony", ("<|channel|>", " to=")),
    ToolFormat("gemma4", ("<|tool_call>call:",)),
    ToolFormat("mistral-args", ("[TOOL_CALLS]", "[ARGS]")),
    ToolFormat("mistral", ("[TOOL_CALLS]",)),
    ToolFormat("qwen-xml", ("<tool_call>", "<function=")),
    ToolFormat("hermes", ("<tool_call>",)),
    ToolFormat("llama3", ('"parameters": ',)),
)


def tool_format(template: str | None) -> ToolFormat | None:
    """Return the tool-call format a chat template speaks (None: the template takes no tools)."""
    if not template or "tools" not in template:
        return None
    fmt = next((fmt for fmt in FORMATS if all(d in template for d in fmt.detect)), None)
    return replace(fmt, thinks="</think>" in template) if fmt is not None else None


def _schema_json(schema: dict) -> str:
    return json.dumps(schema, ensure_ascii=False)


def _params(tool: dict) -> dict:
    params = tool.get("parameters") or {"type": "object", "properties": {}}
    return params


# Keywords whose values are data, not schemas: a "$ref" key inside them is no reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _placed(schema, at: str):
    """Return `schema` as it must read at JSON pointer `at` of a larger schema: each local $ref
    ("#/$defs/X", "#") rewritten to point below `at` (a copy; the tool's own schema is left as it is)."""
    if isinstance(schema, list):
        return [_placed(item, at) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = "#" + at + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _placed(value, at)
    return out


def _pointer_key(key: str) -> str:
    """Return a property name as one step of a JSON pointer (RFC 6901 escapes)."""
    return key.replace("~", "~0").replace("/", "~1")


def _call_object(tools: list[dict], args_key: str, extra: dict | None = None, at: str = "") -> dict:
    """Return a JSON schema: {"name": one tool's name, args_key: its parameters}, name first
    (then the optional `extra` properties); `at`: the JSON pointer where the result will lie."""
    def option(tool: dict, where: str) -> dict:
        args = _placed(_params(tool), f"{where}/properties/{_pointer_key(args_key)}")
        return {"type": "object", "properties": {"name": {"const": tool["name"]}, args_key: args, **(extra or {})},
                "required": ["name", args_key], "additionalProperties": False}

    if len(tools) == 1:
        return option(tools[0], at)
    return {"anyOf": [option(tool, f"{at}/anyOf/{i}") for i, tool in enumerate(tools)]}


def _thinking(marker) -> str:
    """Return the rule for a finished thinking block before the call (Qwen 3 templates open one)."""
    return f"think: /[^<]*/ {marker('</think>')} /\\n*/\n"


def _hermes_grammar(tools, marker) -> str:
    return (f"start: think? {marker('<tool_call>')} \"\\n\" call \"\\n\" {marker('</tool_call>')}\n"
            f"call: %json {_schema_json(_call_object(tools, 'arguments'))}\n")


def _llama3_grammar(tools, marker) -> str:
    return f"start: call\ncall: %json {_schema_json(_call_object(tools, 'parameters'))}\n"


def _mistral_grammar(tools, marker) -> str:
    # Nemo writes each call's 9-character id after its arguments.
    call = _call_object(tools, "arguments", {"id": {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}}, at="/items")
    schema = {"type": "array", "items": call, "minItems": 1, "maxItems": 1}
    return f"start: {marker('[TOOL_CALLS]')} calls\ncalls: %json {_schema_json(schema)}\n"


def _named_alternatives(tools, head) -> str:
    rules, alts = [], []
    for i, t in enumerate(tools):
        alts.append(f"call{i}")
        rules.append(f"call{i}: {head(t['name'])} args{i}\nargs{i}: %json {_schema_json(_params(t))}")
    return "start: " + " | ".join(alts) + "\n" + "\n".join(rules) + "\n"


def _harmony_grammar(tools, marker) -> str:
    # After the generation prompt's `<|start|>assistant`, as the template writes a call back.
    return _named_alternatives(tools, lambda name: (
        f"{json.dumps(' to=functions.' + name)} {marker('<|channel|>')} \"commentary json\" {marker('<|message|>')}"))


def _mistral_args_grammar(tools, marker) -> str:
    return _named_alternatives(tools, lambda name: (
        f"{marker('[TOOL_CALLS]')} {json.dumps(name)} ({marker('[CALL_ID]')} /[a-zA-Z0-9]{{9}}/)? {marker('[ARGS]')}"))


def _qwen_xml_grammar(tools, marker) -> str:
    rules, alts = [], []
    for i, t in enumerate(tools):
        params = _params(t)
        props = params.get("properties") or {}
        required = [k for k in params.get("required", []) if k in props] or list(props)
        parts = []
        for j, key in enumerate(required):
            schema = props[key]
            value = f"v{i}_{j}"
            if schema.get("type") == "string" and "enum" not in schema:
                # One line: the newline before </parameter> ends it (lexemes match as much as they can).
                rules.append(f"{value}: /[^<\\n]*/")
            else:
                rules.append(f"{value}: %json {_schema_json(_value_schema(params, key))}")
            parts.append(f"{json.dumps('<parameter=' + key + '>' + chr(10))} {value} {json.dumps(chr(10) + '</parameter>' + chr(10))}")
        alts.append(f"call{i}")
        head = json.dumps("\n<function=" + t["name"] + ">\n")
        rules.append(f"call{i}: {marker('<tool_call>')} {head} {' '.join(parts)} \"</function>\\n\" {marker('</tool_call>')}")
    return "start: think? (" + " | ".join(alts) + ")\n" + "\n".join(rules) + "\n"


def _value_schema(params: dict, key: str) -> dict:
    """Return the schema of one parameter as the root of a grammar: itself, or, where it refers
    to other parts of the parameters (their $defs), a reference into a copy of them all."""
    schema = params["properties"][key]
    at = "/$defs/parameters"
    if _placed(schema, at) == schema:
        return schema
    return {"$defs": {"parameters": _placed(params, at)}, "$ref": f"#{at}/properties/{_pointer_key(key)}"}


def _gemma4_grammar(tools, marker) -> str:
    raise UsageError("Gemma's tool-call format has no grammar in specrun: forcing a call (tool_choice required or "
                     "named) and tools beside response_format are not supported for it; use tool_choice auto "
                     "without response_format")


_GRAMMARS = {"hermes": _hermes_grammar, "llama3": _llama3_grammar, "mistral": _mistral_grammar,
             "mistral-args": _mistral_args_grammar, "qwen-xml": _qwen_xml_grammar, "harmony": _harmony_grammar,
             "gemma4": _gemma4_grammar}


# ---------------------------------------------------------------------------------------------
# Parsing


def _json_at(text: str, start: int = 0):
    """Return the JSON object or array that begins at `start` (after white space), or None.

    Only there: a call cut short by the token limit must not become a call made of the first
    complete object nested inside its arguments."""
    i = len(text) - len(text[start:].lstrip())
    if text[i: i + 1] not in ("{", "["):
        return None
    try:
        return json.JSONDecoder().raw_decode(text, i)[0]
    except ValueError:
        return None


def _call_from(obj, args_key: str = "arguments") -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        return ParsedCall(obj["name"], args)
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _parse_hermes(text: str):
    calls, content = [], text
    for block in re.finditer(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.S):
        call = _call_from(_json_at(block.group(1)))
        if call:
            calls.append(call)
    if calls:
        content = text[: text.find("<tool_call>")]
    return content.strip(), calls


def _parse_llama3(text: str):
    stripped = text.strip().removeprefix("<|python_tag|>").strip()
    call = _call_from(_json_at(stripped), "parameters")
    return ("", [call]) if call else (text.strip(), [])


def _parse_mistral(text: str):
    at = text.find("[TOOL_CALLS]")
    if at < 0:
        return text.strip(), []
    rest = text[at + len("[TOOL_CALLS]"):]
    calls = []
    if rest.lstrip().startswith("["):
        value = _json_at(rest)
        if isinstance(value, list):
            calls = [c for c in (_call_from(v) for v in value) if c]
    else:  # name[ARGS]{...} (Mistral Small 3.2, Devstral), possibly several
        for match in re.finditer(r"([\w.-]+)(?:\[CALL_ID\]\w+)?\[ARGS\]", rest):
            value = _json_at(rest, match.end())
            if value is not None:
                calls.append(ParsedCall(match.group(1), json.dumps(value, ensure_ascii=False)))
    return text[:at].strip(), calls


def _parse_harmony(text: str):
    calls = []
    pattern = r"to=functions\.([\w.-]+).*?<\|message\|>"
    for match in re.finditer(pattern, text, re.S):
        value = _json_at(text, match.end())
        if value is not None:
            calls.append(ParsedCall(match.group(1), json.dumps(value, ensure_ascii=False)))
    if not calls:
        final = text.split("<|channel|>final<|message|>")
        return final[-1].replace("<|end|>", "").replace("<|return|>", "").strip(), []
    return "", calls


def _parse_qwen_xml(text: str):
    calls = []
    for block in re.finditer(r"<function=([\w.-]+)>(.*?)</function>", text, re.S):
        args = {}
        for param in re.finditer(r"<parameter=([\w.-]+)>\n?(.*?)\n?</parameter>", block.group(2), re.S):
            value = param.group(2)
            try:  # numbers, booleans, objects are written as JSON; strings as they are
                args[param.group(1)] = json.loads(value)
            except ValueError:
                args[param.group(1)] = value
        calls.append(ParsedCall(block.group(1), json.dumps(args, ensure_ascii=False)))
    content = text[: text.find("<tool_call>")] if calls else text
    content = re.sub(r"^.*?</think>", "", content, flags=re.S) if "</think>" in content else content
    return content.strip(), calls


_GEMMA_STRING = '<|"|>'


def _parse_gemma4(text: str):
    calls = []
    for match in re.finditer(r"<\|tool_call>call:([\w.-]+)\{(.*?)\}<tool_call\|>", text, re.S):
        body = match.group(2)
        # Gemma writes strings between <|"|> marks and keys bare: turn that into JSON.
        parts = body.split(_GEMMA_STRING)
        out = []
        for i, part in enumerate(parts):
            if i % 2:
                out.append(json.dumps(part, ensure_ascii=False))
            else:
                out.append(re.sub(r"([{,]\s*|^\s*)([A-Za-z_][\w]*)\s*:", r'\1"\2":', part))
        try:
            args = json.loads("{" + "".join(out) + "}")
        except ValueError:
            continue
        calls.append(ParsedCall(match.group(1), json.dumps(args, ensure_ascii=False)))
    content = text[: text.find("<|tool_call>")] if calls else text
    return content.strip(), calls


_PARSERS = {"hermes": _parse_hermes, "llama3": _parse_llama3, "mistral": _parse_mistral,
            "mistral-args": _parse_mistral, "qwen-xml": _parse_qwen_xml, "harmony": _parse_harmony,
            "gemma4": _parse_gemma4}
