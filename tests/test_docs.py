"""The README and docs/ stay true where a test can tell: every link and anchor resolves, every
`specrun` command and option they name exists, the quick start is what CI runs, and the figures
they quote from the code are the code's."""

from __future__ import annotations

import ast
import itertools
import re
import shlex
import sys
from collections import Counter
from functools import cache
from pathlib import Path

import pytest
import typer
from markdown_it import MarkdownIt

from specrun.cli import app

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPTS = ROOT / "scripts"
# Options of other programs that the docs name for comparison.
OTHER_TOOLS_OPTIONS = {"--fit", "--n-cpu-moe", "--cache-type-k/-v"}  # llama.cpp's own (placement, the KV cache type)
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}
SEPARATORS = {"|", "||", "&&", ";"}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _tokens(page: Path):
    return MarkdownIt("commonmark").enable("table").parse(page.read_text())


def _inline_children(page: Path):
    for token in _tokens(page):
        if token.type == "inline":
            yield from token.children or ()


# ---- links and anchors ------------------------------------------------------------------------


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def _anchors(page: Path) -> frozenset[str]:
    """The page's heading anchors; a repeated heading gets -1, -2... as on GitHub."""
    tokens = _tokens(page)
    headings = ["".join(child.content for child in tokens[i + 1].children or ())
                for i, token in enumerate(tokens) if token.type == "heading_open"]
    seen: Counter[str] = Counter()
    anchors = set()
    for slug in map(_slug, headings):
        anchors.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
        seen[slug] += 1
    return frozenset(anchors)


def _links(page: Path) -> list[str]:
    return [child.attrs["href"] for child in _inline_children(page) if child.type == "link_open"]


def _broken_links(page: Path) -> list[str]:
    broken = []
    for href in _links(page):
        if re.match(r"^[a-z]+:", href):
            continue  # a web address
        path, _, anchor = href.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{href}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{href}: no heading with that anchor in {target.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_and_anchor_resolves(page):
    assert _broken_links(page) == []


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / href.partition("#")[0]).resolve() for href in _links(ROOT / "README.md")}
    assert [p.name for p in PAGES[1:] if p not in linked] == []


# ---- commands and options -----------------------------------------------------------------------


@cache
def _cli_options() -> dict[str, frozenset[str]]:
    """{command: the options it takes} for every `specrun` command."""
    group = typer.main.get_command(app)
    return {name: frozenset(opt for param in command.params for opt in (*param.opts, *param.secondary_opts)
                            if opt.startswith("--")) | {"--help"}
            for name, command in group.commands.items()}


def _argparse_options(script: Path) -> frozenset[str]:
    calls = (node for node in ast.walk(ast.parse(script.read_text())) if isinstance(node, ast.Call))
    return frozenset(arg.value for call in calls if getattr(call.func, "attr", "") == "add_argument"
                     for arg in call.args if isinstance(arg, ast.Constant) and str(arg.value).startswith("--"))


@cache
def _script_options() -> dict[str, frozenset[str]]:
    """{script path: its options} for the scripts under scripts/ (a .sh passes its options to its .py)."""
    options = {f"scripts/{s.name}": _argparse_options(s) | {"--help"} for s in SCRIPTS.glob("*.py")}
    for shell in SCRIPTS.glob("*.sh"):
        options[f"scripts/{shell.name}"] = options.get(f"scripts/{shell.stem}.py", frozenset())
    return options


def _any_option() -> frozenset[str]:
    return frozenset().union(*_cli_options().values(), *_script_options().values(), OTHER_TOOLS_OPTIONS)


def _command_lines(page: Path) -> list[str]:
    """The shell command lines of a page: shell code blocks (continuations joined) and code spans."""
    lines = []
    for token in _tokens(page):
        if token.type in ("fence", "code_block") and token.info.strip() in SHELL_BLOCKS:
            for line in token.content.replace("\\\n", " ").splitlines():
                if line[:1].isspace() and lines:
                    lines[-1] += " " + line  # a usage line continued, indented
                elif line.strip():
                    lines.append(line)
    lines += [child.content for child in _inline_children(page) if child.type == "code_inline"]
    return lines


def _split(line: str) -> list[list[str]]:
    """The line's commands as word lists (comments, brackets and environment assignments dropped)."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        words = line.split()  # a quote left open: a fragment of JSON or text, not a command
    commands, current = [], []
    for word in words:
        if word in SEPARATORS:
            commands.append(current)
            current = []
        elif current or not ENV_ASSIGNMENT.match(word):  # VAR=value before a command sets its environment
            current.append(word.strip("[]"))
    return [c for c in commands + [current] if c]


def _unknown_options(words: list[str]) -> list[str]:
    """The options in one command that the command it names does not take."""
    head, rest = words[0], words[1:]
    if head in ("python", "python3") and rest[:2] == ["-m", "specrun"]:
        head, rest = "specrun", rest[2:]
    if head == "specrun":
        if not rest or rest[0].startswith("--"):
            return [w for w in rest if w.startswith("--") and w not in ("--help", "--version")]
        if rest[0] not in _cli_options():
            return [f"specrun {rest[0]} (no such command)"]
        head, rest = rest[0], rest[1:]
    if head in ("python", "python3", "bash") and rest and rest[0] in _script_options():
        allowed = _script_options()[rest[0]]
        if "--" in rest:  # what follows goes to `specrun generate`
            cut = rest.index("--")
            return _unknown(rest[1:cut], allowed) + _unknown(rest[cut + 1:], _cli_options()["generate"])
        return _unknown(rest[1:], allowed)
    if head in _cli_options():
        return _unknown(rest, _cli_options()[head])
    if head.startswith("--"):
        return _unknown(words, _any_option())
    return []  # another program (pip, curl, aider...) or not a command


def _unknown(words: list[str], allowed: frozenset[str]) -> list[str]:
    return [w for w in (w.split("=")[0] for w in words) if w.startswith("--") and w != "--" and w not in allowed]


def _unknown_in_page(page: Path) -> list[str]:
    return [f"{option} in `{line}`" for line in _command_lines(page) for words in _split(line)
            for option in _unknown_options(words)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_and_option_named_exists(page):
    assert _unknown_in_page(page) == []


def test_a_command_or_option_that_does_not_exist_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Run `specrun generate --speed 9`, `specrun fly`, `bench --report --colour`, `--warp`\n\n"
                    "    cat a.txt | specrun chat --no-lookup --turbo  # a comment --not-an-option\n"
                    "    python scripts/bench_fresh.py --tokens 9 --nope -- --budget 4 --also-nope\n")
    assert _unknown_in_page(page) == [
        "--turbo in `cat a.txt | specrun chat --no-lookup --turbo  # a comment --not-an-option`",
        "--nope in `python scripts/bench_fresh.py --tokens 9 --nope -- --budget 4 --also-nope`",
        "--also-nope in `python scripts/bench_fresh.py --tokens 9 --nope -- --budget 4 --also-nope`",
        "--speed in `specrun generate --speed 9`",
        "specrun fly (no such command) in `specrun fly`",
        "--colour in `bench --report --colour`",
        "--warp in `--warp`",
    ]


# ---- the quick start is what CI runs --------------------------------------------------------------


def _section_code(page: Path, heading: str) -> list[str]:
    """The code blocks of the section under `heading`, in order."""
    tokens, blocks, inside = _tokens(page), [], False
    for i, token in enumerate(tokens):
        if token.type == "heading_open":
            inside = tokens[i + 1].content == heading
        elif inside and token.type in ("fence", "code_block"):
            blocks.append(token.content.strip())
    return blocks


def test_the_quick_start_is_two_commands_and_ci_runs_the_second():
    install_and_run, test = _section_code(ROOT / "README.md", "Quick start")
    assert install_and_run.endswith('pip install . && specrun generate "Write a haiku about the sea."')
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert ci[-1] == test


def test_the_gpu_install_asks_for_the_llama_cpp_python_specrun_requires():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    required = next(d for d in pyproject["project"]["dependencies"] if d.startswith("llama-cpp-python"))
    gpu = _section_code(ROOT / "README.md", "On a GPU")[0]
    assert f'pip install "{required}"' in gpu


# ---- figures quoted from the code ---------------------------------------------------------------

WORDS = {3: "three", 4: "four"}


def _text(page: str) -> str:
    return " ".join((ROOT / page).read_text().split())


def _quoted_figures() -> list[tuple[str, str]]:
    """(page, a phrase built from the constant it quotes)."""
    from specrun.commands.tune import FULL, QUICK
    from specrun.core.sampling import NEAR_TIE_NATS, SamplingParams
    from specrun.decoding.adaptive import STRONG_ORDER
    from specrun.decoding.pay.rules import CHECK_FLOOR, DEFAULT_MARGIN, PROFILE_DRIFT, STEP_MARGIN, UNTUNED_MARGIN
    from specrun.experiments.workloads import KINDS, ROUNDS
    from specrun.hardware.placement import AUTO_CTX_STEP, MIN_AUTO_CTX
    from specrun.runtime.options import DEFAULT_CTX
    from specrun.runtime.plan import DEFAULT_PARALLEL
    from specrun.runtime.trees import DEFAULT_SHAPE, MAX_CHAIN, MAX_CHAINS, MTP_CHAIN
    from specrun.server.app import MAX_BODY_BYTES
    from specrun.server.connections import MAX_CONNECTIONS, MAX_HEAD_BYTES, MAX_HEADERS
    from specrun.server.ollama import DEFAULTS
    from specrun.server.schemas import DEFAULT_TEMPERATURE

    serve = {p.name: p.default for p in typer.main.get_command(app).commands["serve"].params}
    assert DEFAULT_SHAPE.width == 1, "the docs call the default tree a chain"
    return [
        ("docs/serving.md", f"a queue of `--queue-size` requests (default {serve['queue_size']})"),
        ("docs/serving.md", f"within `--read-timeout` seconds ({serve['read_timeout']:g}; 408)"),
        ("docs/serving.md", f"at the context one request gets, {DEFAULT_PARALLEL} at most"),
        ("docs/serving.md", f"Request bodies are limited to {MAX_BODY_BYTES >> 20} MiB (413)"),
        ("docs/serving.md", f"A request head is limited to {MAX_HEAD_BYTES >> 10} KiB and {MAX_HEADERS} headers (431)"),
        ("docs/serving.md", f"At most {MAX_CONNECTIONS} connections are open at once"),
        ("docs/serving.md", f"`temperature`: default {DEFAULT_TEMPERATURE:g}"),
        ("docs/serving.md", f"the last {SamplingParams().repeat_last_n} generated tokens"),
        ("docs/serving.md", "Ollama's defaults (temperature {temperature}, top_k {top_k}, top_p {top_p})".format(**DEFAULTS)),
        ("README.md", f"a chain of {DEFAULT_SHAPE.budget} tokens"),
        ("docs/tuning.md", f"a chain of {DEFAULT_SHAPE.budget} tokens"),
        ("docs/tuning.md", f"the tree at {CHECK_FLOOR:.2f}x plain decoding or faster"),
        ("docs/tuning.md", f"more than {DEFAULT_MARGIN:.0%} slower than the untuned default"),
        ("docs/tuning.md", f"runs some workload more than {UNTUNED_MARGIN:.0%} slower than it"),
        ("docs/tuning.md", f"{WORDS[ROUNDS // 2].capitalize()} requests of each of {WORDS[KINDS]} kinds predict"),
        ("docs/tuning.md", f"{FULL.workload_tokens} tokens each ({QUICK.workload_tokens} with `--quick`)"),
        ("docs/tuning.md", f"more than {PROFILE_DRIFT:.0%} off the profile's"),
        ("docs/tuning.md", f"would not beat plain steps by {STEP_MARGIN:.0%}"),
        ("docs/models.md", f"up to {WORDS[MAX_CHAINS]} chains (the proposal's best paths, at most {MAX_CHAIN} drafts each)"),
        ("docs/models.md", f"lowered in steps of {AUTO_CTX_STEP}"),
        ("docs/models.md", f"a MoE model's experts) that a {MIN_AUTO_CTX}-token context would keep"),
        ("docs/models.md", f"`generate`, `bench` and `tune` use {DEFAULT_CTX} tokens"),
        ("docs/how-it-works.md", f"up to {WORDS[MAX_CHAINS]} of the proposal's best paths (at most {MAX_CHAIN} drafts each)"),
        ("docs/how-it-works.md", f"a match of {WORDS[STRONG_ORDER]} tokens or more is watched at once"),
        ("docs/how-it-works.md", f"a chain ({MTP_CHAIN} drafts by default"),
        ("docs/exactness.md", f"less than `NEAR_TIE_NATS` = {NEAR_TIE_NATS:g} nats"),
    ]


def test_figures_quoted_from_the_code_are_the_codes():
    assert [(page, phrase) for page, phrase in _quoted_figures() if phrase not in _text(page)] == []


def _first_column_names(page: str, header: str) -> set[str]:
    """The `names` in the first column of the table whose header row is `header`."""
    lines = (ROOT / page).read_text().splitlines()
    rows = itertools.takewhile(lambda line: line.startswith("|"), lines[lines.index(header) + 2:])  # past |---|
    return {name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}


def test_the_timings_table_lists_what_the_server_sends():
    from specrun.decoding.steps import GenerationStats
    from specrun.server.jobs import Started
    from specrun.server.responses import timings

    started = Started(n_prompt=1, n_cached=0, max_tokens=1, requested_max_tokens=None)
    assert _first_column_names("docs/serving.md", "| field | meaning |") == set(timings(started, GenerationStats()))


def test_the_jsonl_fields_are_the_ones_a_line_may_carry():
    from specrun.runtime.request_json import FIELDS

    assert _first_column_names("docs/generate.md", "| field | meaning |") == set(FIELDS)


def test_every_module_is_named_in_layers_md():
    spans = re.findall(r"`([^`]+)`", (ROOT / "docs" / "layers.md").read_text())
    named = {part for span in spans for part in re.split(r"[./ ]", span)}
    modules = {p.stem for p in (ROOT / "specrun").rglob("*.py") if p.stem not in ("__init__", "__main__")}
    assert sorted(modules - named) == []
