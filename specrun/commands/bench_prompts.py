"""`specrun bench`'s prompts: built-in sets per workload, or a file (JSONL or one prompt per line)."""

from __future__ import annotations

import json
from pathlib import Path

from specrun.errors import UsageError
from specrun.inputs import decode_utf8

# Pasted texts, also the copy prompts of the lookup tests.
FUNCTION = '''def moving_average(values, window):
    """Return the moving averages of values over window items."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''
_PARSER = '''def parse_config(lines):
    """Return the key = value pairs of lines as a dict, skipping comments and blank lines."""
    config = {}
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise ValueError(f"line {number}: expected key = value")
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config
'''
LIGHTHOUSE = (
    "The lighthouse keeper climbed the stairs every night at nine. He wound the clockwork, trimmed "
    "the wick and wrote the weather in his log: wind from the west, a light swell, fog after "
    "midnight. In forty years he had missed one night, when the storm of 1953 tore the door off "
    "its hinges, and even then the light had turned until dawn."
)
_MEETING = (
    "The council met on Tuesday to discuss the new bus routes. Residents of the north district "
    "asked for a stop near the school. The transport office said the change would cost about "
    "twelve thousand euros a year. A decision was postponed until the budget review in March."
)

# Each workload holds four kinds of request, eight times over in the same order: prompts i, i + 4,
# i + 8, ... ask alike of the same pasted text (another change, other words; for chat, another
# question of the same kind). `tune` predicts from the even rounds and measures on the odd ones,
# so both halves hold the same mix: how much of an answer a small model copies swings by 3x
# between pasted texts and kinds of edit, and two halves of four unlike prompts differed by up to
# 44% for that alone. Two requests of one kind still differ by up to 3x
# (one copies the function whole, its sibling rewrites it; Gemma-270M repeats itself answering
# one chat question and not the next), which only more requests a kind per half average down:
# with two a kind, a full tune's chat prediction for the Gemma pair missed by 22-23% twice.

# Free-form questions: little to copy from the prompt.
CHAT = [
    "Explain why the sky is blue to a ten-year-old.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List five tips for staying productive when working from home.",
    "What are the main differences between TCP and UDP?",
    "Explain how a rainbow forms to a ten-year-old.",
    "Write a short story about a baker who finds a map baked into a loaf of bread.",
    "List five tips for sleeping better at night.",
    "What are the main differences between RAM and a hard disk?",
    "Explain why leaves change colour in autumn to a ten-year-old.",
    "Write a short story about a postman who finds a letter addressed to himself.",
    "List five tips for learning a new language.",
    "What are the main differences between a virus and a bacterium?",
    "Explain how a magnet works to a ten-year-old.",
    "Write a short story about a gardener who finds a key buried under a rose bush.",
    "List five tips for cooking on a small budget.",
    "What are the main differences between Python and JavaScript?",
    "Explain why the sea is salty to a ten-year-old.",
    "Write a short story about a librarian who finds a note hidden in a returned book.",
    "List five tips for saving money on groceries.",
    "What are the main differences between a crocodile and an alligator?",
    "Explain how airplanes stay in the air to a ten-year-old.",
    "Write a short story about a fisherman who finds a brass compass in his net.",
    "List five tips for training for your first marathon.",
    "What are the main differences between weather and climate?",
    "Explain why we have seasons to a ten-year-old.",
    "Write a short story about a teacher who finds a time capsule under the playground.",
    "List five tips for keeping houseplants alive.",
    "What are the main differences between HTTP and HTTPS?",
    "Explain how the heart pumps blood to a ten-year-old.",
    "Write a short story about a painter who finds a door behind her canvas.",
    "List five tips for writing a good cover letter.",
    "What are the main differences between Git and Subversion?",
]
# A pasted function (fenced, as chat users paste code) rewritten with a small change, the whole
# function in the answer.
CODE = [
    f"Add type hints to this Python function and reply with the complete updated function.\n\n```python\n{FUNCTION}```",
    f"Rename the variable `total` to `running_sum` in this function. Reply with the full function only.\n\n```python\n{FUNCTION}```",
    f"Here is a function:\n\n```python\n{_PARSER}```\n\nChange it to also skip lines that start with ';'. Show the full updated function.",
    f"```python\n{_PARSER}```\n\nAdd a docstring example to the function above. Output the whole function.",
    f"Add type annotations to every parameter and to the return value of this function. Reply with the complete function.\n\n```python\n{FUNCTION}```",
    f"Rename the parameter `window` to `size` in this function. Reply with the full function only.\n\n```python\n{FUNCTION}```",
    f"Here is a function:\n\n```python\n{_PARSER}```\n\nChange it to also skip lines that start with '//'. Show the full updated function.",
    f"```python\n{_PARSER}```\n\nAdd a docstring example that parses two lines to the function above. Output the whole function.",
    f"Add type hints to the parameters and the return value of this function, then reply with the whole function.\n\n```python\n{FUNCTION}```",
    f"Rename the variable `out` to `averages` in this function. Reply with the full function only.\n\n```python\n{FUNCTION}```",
    f"Here is a function:\n\n```python\n{_PARSER}```\n\nChange it to also skip lines that start with '--'. Show the full updated function.",
    f"```python\n{_PARSER}```\n\nAdd a doctest example to the docstring of the function above. Output the whole function.",
    f"Annotate this function with Python type hints. Reply with the complete function and nothing else.\n\n```python\n{FUNCTION}```",
    f"Rename the loop variable `value` to `item` in this function. Reply with the full function only.\n\n```python\n{FUNCTION}```",
    f"Here is a function:\n\n```python\n{_PARSER}```\n\nChange it to also skip lines that start with 'REM'. Show the full updated function.",
    f"```python\n{_PARSER}```\n\nAdd a docstring example with a comment line to the function above. Output the whole function.",
    f"Add type hints to this function, using list[float] for the values, and reply with the complete function.\n\n```python\n{FUNCTION}```",
    f"Rename the function `moving_average` to `rolling_mean`. Reply with the full function only.\n\n```python\n{FUNCTION}```",
    f"Here is a function:\n\n```python\n{_PARSER}```\n\nChange it to also skip lines that start with '!'. Show the full updated function.",
    f"```python\n{_PARSER}```\n\nAdd a docstring example with an empty input to the function above. Output the whole function.",
    f"Give this function type hints for its arguments and its result. Reply with the entire function.\n\n```python\n{FUNCTION}```",
    f"Rename the loop index `i` to `index` in this function. Reply with the full function only.\n\n```python\n{FUNCTION}```",
    f"Here is a function:\n\n```python\n{_PARSER}```\n\nChange it to also skip lines that start with '%'. Show the full updated function.",
    f"```python\n{_PARSER}```\n\nAdd a short usage example to the docstring of the function above. Output the whole function.",
    f"Add Python type hints to this function. Reply with the complete updated function.\n\n```python\n{FUNCTION}```",
    f"Rename the parameter `values` to `numbers` in this function. Reply with the full function only.\n\n```python\n{FUNCTION}```",
    f"Here is a function:\n\n```python\n{_PARSER}```\n\nChange it to also skip lines that start with '*'. Show the full updated function.",
    f"```python\n{_PARSER}```\n\nAdd a docstring example whose input has a blank line to the function above. Output the whole function.",
    f"Type-annotate this function, its parameters and its return value. Reply with the complete function.\n\n```python\n{FUNCTION}```",
    f"Rename the variable `total` to `window_sum` in this function. Reply with the full function only.\n\n```python\n{FUNCTION}```",
    f"Here is a function:\n\n```python\n{_PARSER}```\n\nChange it to also skip lines that start with '>'. Show the full updated function.",
    f"```python\n{_PARSER}```\n\nAdd a docstring example with a key that contains spaces to the function above. Output the whole function.",
]
# A pasted text copied with small changes, or sentences extracted verbatim.
REWRITE = [
    f"Copy this text, replacing 'lighthouse keeper' with 'keeper of the light':\n\n{LIGHTHOUSE}",
    f"Quote the first two sentences of this text verbatim:\n\n{LIGHTHOUSE}",
    f"Rewrite this text in the past perfect tense, changing nothing else:\n\n{_MEETING}",
    f"Extract, word for word, the sentence about the cost:\n\n{_MEETING}",
    f"Copy this text, replacing 'forty years' with 'four decades':\n\n{LIGHTHOUSE}",
    f"Quote the last two sentences of this text verbatim:\n\n{LIGHTHOUSE}",
    f"Rewrite this text in the future tense, changing nothing else:\n\n{_MEETING}",
    f"Extract, word for word, the sentence about the school:\n\n{_MEETING}",
    f"Copy this text, replacing 'nine' with 'ten':\n\n{LIGHTHOUSE}",
    f"Quote the second and third sentences of this text verbatim:\n\n{LIGHTHOUSE}",
    f"Rewrite this text in the present tense, changing nothing else:\n\n{_MEETING}",
    f"Extract, word for word, the sentence about the decision:\n\n{_MEETING}",
    f"Copy this text, replacing 'the storm of 1953' with 'the great storm':\n\n{LIGHTHOUSE}",
    f"Quote the first and the last sentence of this text verbatim:\n\n{LIGHTHOUSE}",
    f"Rewrite this text in the present perfect tense, changing nothing else:\n\n{_MEETING}",
    f"Extract, word for word, the sentence about the meeting day:\n\n{_MEETING}",
    f"Copy this text, replacing 'clockwork' with 'winding gear':\n\n{LIGHTHOUSE}",
    f"Quote the third sentence of this text verbatim:\n\n{LIGHTHOUSE}",
    f"Rewrite this text in the future perfect tense, changing nothing else:\n\n{_MEETING}",
    f"Extract, word for word, the sentence that names a month:\n\n{_MEETING}",
    f"Copy this text, replacing 'fog after midnight' with 'rain before dawn':\n\n{LIGHTHOUSE}",
    f"Quote the sentence about the storm verbatim:\n\n{LIGHTHOUSE}",
    f"Rewrite this text so that the meeting was on Thursday, changing nothing else:\n\n{_MEETING}",
    f"Extract, word for word, the last sentence:\n\n{_MEETING}",
    f"Copy this text, replacing 'He' with 'She' and 'his' with 'her':\n\n{LIGHTHOUSE}",
    f"Quote the first sentence of this text verbatim:\n\n{LIGHTHOUSE}",
    f"Rewrite this text in the first person plural, as the council, changing nothing else:\n\n{_MEETING}",
    f"Extract, word for word, the sentence about the residents' request:\n\n{_MEETING}",
    f"Copy this text, replacing 'the stairs' with 'the spiral staircase':\n\n{LIGHTHOUSE}",
    f"Quote the sentence about the log verbatim:\n\n{LIGHTHOUSE}",
    f"Rewrite this text with 'council' replaced by 'city board', changing nothing else:\n\n{_MEETING}",
    f"Extract, word for word, the first sentence:\n\n{_MEETING}",
]
WORKLOADS = {"chat": CHAT, "code": CODE, "rewrite": REWRITE}
KINDS = 4  # kinds of request per workload: WORKLOADS[w][i + r * KINDS] is request r of kind i
ROUNDS = 8  # requests of each kind


def workload_prompts(workload: str, path: Path | None) -> dict[str, list[str]]:
    """Return {workload: prompts}: the file's prompts (as one workload, "prompts"), or the built-in
    set named (all of them for "all"): one request of each kind (tune measures the other rounds)."""
    if path is not None:
        return {"prompts": load_prompts(path)}
    if workload == "all":
        return {name: prompts[:KINDS] for name, prompts in WORKLOADS.items()}
    if workload not in WORKLOADS:
        raise UsageError(f"unknown workload {workload!r}: choose chat, code, rewrite or all")
    return {workload: WORKLOADS[workload][:KINDS]}


def load_prompts(path: Path) -> list[str]:
    """Return a file's prompts: JSONL ({"prompt": "..."} per line, for multi-line prompts) or one
    prompt per line."""
    try:
        lines = [line.strip() for line in decode_utf8(path.read_bytes(), f"prompts file {path}").splitlines()]
    except OSError as e:
        raise UsageError(f"cannot read prompts file {path}: {e.strerror}") from None
    lines = [line for line in lines if line]
    if not lines:
        raise UsageError(f"prompts file {path} has no prompts")
    if not lines[0].startswith("{"):
        return lines
    prompts = []
    for number, line in enumerate(lines, start=1):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"prompts file {path}, line {number}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
            raise UsageError(f'prompts file {path}, line {number}: expected {{"prompt": "..."}}')
        prompts.append(obj["prompt"])
    return prompts
