"""The `specrun` command line. Commands parse options, call one function, and print via ui.py.

Heavy modules (llama_cpp, numpy work) are imported inside the commands, so `specrun --help`
starts instantly.
"""

from __future__ import annotations

import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer

from specrun import __version__
from specrun.cli_options import (
    TargetOpt, DraftOpt, GpuLayersOpt, GpuMemoryOpt, MmapOpt, FlashAttnOpt, KvTypeOpt, KvSplitOpt,
    CtxOpt, AutoCtxOpt, ReasoningFormatOpt, ChatTemplateOpt,
    ThreadsOpt, BudgetOpt, DepthOpt, NoSpecOpt, LookupOpt, MemoryOpt, VerboseOpt, ParallelOpt, ThroughputOpt, RpcOpt,
    TemperatureOpt, TopKOpt, TopPOpt, MinPOpt, SeedOpt, PresenceOpt, FrequencyOpt, RepeatOpt, SystemOpt, HeadOpt,
    WorkerCacheOpt, examples as _examples,
)
from specrun.errors import SpecrunError, UsageError
from specrun.limits import RPC_DEFAULT_PORT


app = typer.Typer(
    name="specrun",
    help="Fast local LLM decoding with speculative draft trees on llama.cpp.\n\n"
    "A small draft model proposes a tree of continuations and the target model checks the whole "
    "tree in one pass; the output is exactly what the target alone would write. With no --target, "
    "an offline demo pair (SmolLM2-135M) is used.",
    epilog=_examples(
        'specrun generate "Write a haiku about the sea."',
        "specrun chat --target qwen2.5-14b --draft qwen2.5-0.5b",
        "specrun pull qwen2.5-14b",
        "specrun tune --target qwen2.5-14b",
        "specrun models",
    ),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)

_verbose = False


def _setup_logging(verbose: bool) -> None:
    global _verbose
    _verbose = verbose
    from specrun import ui

    ui.setup_logging(verbose)


def _run_options(target, draft, gpu_layers, ctx_size, threads, budget, depth, no_spec, lookup=None, quiet=False,
                 gpu_memory=None, rpc=None, parallel: int | None = 1, memory=False, memory_scope=None, throughput=False,
                 mmap=None, flash_attn=None, kv_type=None, reproducible=False, kv_split=False, head=None):
    from specrun.runtime.plan import RunOptions

    limit = None
    if gpu_memory is not None:
        from specrun.commands.plan import parse_bytes

        limit = parse_bytes(gpu_memory, "--gpu-memory")
        if limit <= 0:
            raise UsageError(f"--gpu-memory {gpu_memory!r}: the limit must be more than 0")
    for name, value, choices in (("--flash-attn", flash_attn, ("auto", "on", "off")), ("--head", head, ("auto", "here", "workers"))):
        if value not in (None, *choices):
            raise UsageError(f"{name} {value!r}: choose {', '.join(choices[:-1])} or {choices[-1]}")
    from specrun.engine import KV_TYPES, kv_quantized

    if kv_type is not None and kv_type not in KV_TYPES:
        raise UsageError(f"--kv-type {kv_type!r}: choose {', '.join(KV_TYPES)}")
    if kv_quantized(kv_type) and flash_attn == "off":
        raise UsageError(f"--kv-type {kv_type} needs flash attention: drop --flash-attn off")
    endpoints = ()
    if rpc:
        from specrun.engine.rpc import parse_endpoints
        endpoints = parse_endpoints(rpc)
    return RunOptions(
        target=target, draft=draft, gpu_layers=gpu_layers, ctx_size=ctx_size, threads=threads,
        budget=budget, depth=depth, no_spec=no_spec, lookup=lookup, quiet=quiet, gpu_memory=limit, rpc=endpoints,
        parallel=parallel, memory=memory, memory_scope=memory_scope, throughput=throughput, mmap=mmap,
        flash_attn=flash_attn, kv_type=kv_type, reproducible=reproducible, kv_split=kv_split, head=None if head == "auto" else head)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"specrun {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_version_callback, is_eager=True, help="Show the version and exit.")] = False,
) -> None:
    """Fast local LLM decoding with speculative draft trees on llama.cpp."""


# ---------------------------------------------------------------------------------------------
# generate


@app.command(
    epilog=_examples(
        'specrun generate "Explain KV caches in two sentences."',
        "cat prompt.txt | specrun generate --max-tokens 200 --stats",
        'specrun generate --raw --no-spec "def fib(n):"',
        'specrun generate --json --stop "." "Name one colour."',
        'specrun generate --json-schema person.json "Describe a person as JSON."',
        'specrun generate --json --logprobs 3 "The capital of France is"',
        "cat prompts.txt | specrun generate --lines --json > results.jsonl",
        "cat requests.jsonl | specrun generate --jsonl > results.jsonl",
        note=(
            "Text on stdin or in --file is ONE prompt, all lines joined; --lines makes each line a",
            "prompt of its own (answers separated by a blank line, or one JSON object per line).",
            "",
            "Each --jsonl line: {\"prompt\": ..., \"max_tokens\"?, \"temperature\"?, \"top_k\"?, \"top_p\"?,",
            "\"min_p\"?, \"seed\"?, \"stop\"?, \"chat\"?, \"system\"?, \"presence_penalty\"?, \"frequency_penalty\"?,",
            "\"repeat_penalty\"?, \"logit_bias\"?, \"logprobs\"?, \"json_schema\"?, \"grammar\"?, \"reproducible\"?, \"id\"?};",
            "each result:",
            "text, token_ids, n_tokens, tokens_per_s, accepted_per_pass, finish_reason, logprobs if asked",
            "(or error and line).",
        ),
    )
)
def generate(
    prompt: Annotated[Optional[str], typer.Argument(help="The prompt; - or nothing reads stdin.", show_default=False)] = None,
    file: Annotated[Optional[Path], typer.Option("--file", "-f", help="Read the prompt (or JSONL requests) from a file.")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", min=1, help="Maximum tokens to generate.")] = 256,
    temperature: TemperatureOpt = 0.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    min_p: MinPOpt = 0.0,
    seed: SeedOpt = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop when this text appears; it is not printed (repeatable).")] = None,
    chat: Annotated[Optional[bool], typer.Option("--chat/--raw", help="Wrap the prompt in the model's chat template, or not  [default: chat for models with a template].", show_default=False)] = None,
    system: SystemOpt = None,
    presence_penalty: PresenceOpt = 0.0,
    frequency_penalty: FrequencyOpt = 0.0,
    repeat_penalty: RepeatOpt = 1.0,
    json_schema: Annotated[Optional[Path], typer.Option("--json-schema", help="The answer is JSON valid under this JSON schema file (exact under speculation).")] = None,
    grammar: Annotated[Optional[Path], typer.Option("--grammar", help="The answer follows this GBNF (llama.cpp) or Lark grammar file.")] = None,
    logprobs: Annotated[Optional[int], typer.Option("--logprobs", min=0, max=20, help="With --json: each token's log-prob and this many likeliest alternatives.")] = None,
    parse_special: Annotated[bool, typer.Option("--parse-special/--no-parse-special", help="In a raw prompt (--raw), special-token text such as <|im_start|> becomes special tokens, as in llama.cpp's tools; --no-parse-special keeps it text. Chat messages are always text.")] = True,
    reproducible: Annotated[bool, typer.Option("--reproducible", help="The same answer whatever else runs: passes of its own from a fresh prefill (greedy: plain decoding's answer bit for bit): one token each, at plain decoding's speed, or greedy chains where the target's chains measure as one-token passes at start (a build without llamafile; a Q4_1 target with --kv-type q8_0; docs/exactness.md).")] = False,
    stats: Annotated[bool, typer.Option("--stats", help="Print a summary on stderr.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object with text and stats.")] = False,
    lines: Annotated[bool, typer.Option("--lines", help="Each input line (stdin or --file) is a prompt of its own; models load once.")] = False,
    jsonl: Annotated[bool, typer.Option("--jsonl", help="Read JSON requests line by line; write one JSON result per line.")] = False,
    parallel: Annotated[int, typer.Option("--parallel", min=1, max=64, help="With --jsonl: decode this many lines together, their target passes shared; results still in input order.")] = 1,
    throughput: ThroughputOpt = False,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    gpu_layers: GpuLayersOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    mmap: MmapOpt = None,
    flash_attn: FlashAttnOpt = None,
    kv_type: KvTypeOpt = None,
    kv_split: KvSplitOpt = False,
    rpc: RpcOpt = None,
    head: HeadOpt = None,
    ctx_size: CtxOpt = 4096,
    threads: ThreadsOpt = None,
    budget: BudgetOpt = None,
    depth: DepthOpt = None,
    no_spec: NoSpecOpt = False,
    lookup: LookupOpt = None,
    memory: MemoryOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Generate text for a prompt (argument, --file or stdin), streaming it to stdout.

    Text from stdin or --file is one prompt (all its lines together); --lines answers each line
    on its own, --jsonl answers one JSON request per line.
    """
    _setup_logging(verbose)
    with _user_errors():
        from specrun.commands import generate as generate_command
        from specrun.inputs import json_schema_file, option_file, read_prompt
        from specrun.runtime.request import Request

        if jsonl and as_json:
            raise UsageError("--json and --jsonl do not go together (--jsonl already writes JSON)")
        if jsonl and lines:
            raise UsageError("--lines and --jsonl do not go together (--jsonl already reads one request per line)")
        if system is not None and chat is False:
            raise UsageError("--system needs chat mode (drop --raw)")
        if (parallel > 1 or throughput) and not jsonl:
            raise UsageError(f"{'--parallel' if parallel > 1 else '--throughput'} needs --jsonl: only JSONL requests are decoded together")
        opts = _run_options(target, draft, gpu_layers, ctx_size, threads, budget, depth, no_spec, lookup, gpu_memory=gpu_memory, mmap=mmap, flash_attn=flash_attn, kv_type=kv_type, rpc=rpc, head=head, parallel=parallel, memory=memory, throughput=throughput,
                            reproducible=reproducible and not jsonl, kv_split=kv_split)  # (--jsonl: each line says)
        if logprobs is not None and not (as_json or jsonl):
            raise UsageError("--logprobs needs --json (or --jsonl): log-probs are reported in the JSON output")
        request = Request(
            max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            seed=seed, stop=tuple(stop or ()), chat=chat, system=system, parse_special=parse_special,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, repeat_penalty=repeat_penalty,
            logprobs=logprobs, json_schema=json_schema_file(json_schema), grammar=option_file(grammar, "--grammar"),
            reproducible=reproducible,
        )
        if jsonl:
            if prompt is not None and prompt != "-":
                raise UsageError("--jsonl reads requests from stdin or --file, not from an argument")
            generate_command.generate_jsonl(opts, request, file)
            return
        if lines:
            if prompt is not None and prompt != "-":
                raise UsageError("--lines reads prompts from stdin or --file, not from an argument")
            if generate_command.generate_lines(opts, request, file, show_stats=stats, as_json=as_json):
                raise typer.Exit(2)  # some lines were refused (each one said why)
            return
        text = read_prompt(prompt, file)
        generate_command.generate_one(opts, request, text, show_stats=stats, as_json=as_json)


# ---------------------------------------------------------------------------------------------
# chat


@app.command(
    epilog=_examples(
        "specrun chat",
        'specrun chat --target qwen2.5-14b --system "You are a terse assistant."',
        "specrun chat --target gemma3-4b --temperature 0.7 --max-tokens 512",
        note=(
            "In the chat: /help, /reset, /stats, /save FILE, /exit. Ctrl-C stops an answer;",
            "Ctrl-D (or Ctrl-C twice at the prompt) leaves.",
        ),
    )
)
def chat(
    system: SystemOpt = None,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", "-n", min=1, help="Longest answer in tokens (default: until the model ends its turn or the context is full).")] = None,
    temperature: TemperatureOpt = 0.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    min_p: MinPOpt = 0.0,
    seed: SeedOpt = None,
    reasoning_format: ReasoningFormatOpt = "auto",
    chat_template: ChatTemplateOpt = None,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    gpu_layers: GpuLayersOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    mmap: MmapOpt = None,
    flash_attn: FlashAttnOpt = None,
    kv_type: KvTypeOpt = None,
    rpc: RpcOpt = None,
    head: HeadOpt = None,
    ctx_size: AutoCtxOpt = None,
    threads: ThreadsOpt = None,
    budget: BudgetOpt = None,
    depth: DepthOpt = None,
    no_spec: NoSpecOpt = False,
    lookup: LookupOpt = None,
    memory: MemoryOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Chat with a model in the terminal, using its own chat template; answers stream as they are made."""
    _setup_logging(verbose)
    with _user_errors():
        from specrun.commands import chat as chat_command
        from specrun.runtime.request import Request

        opts = _run_options(target, draft, gpu_layers, ctx_size, threads, budget, depth, no_spec, lookup, gpu_memory=gpu_memory, mmap=mmap, flash_attn=flash_attn, kv_type=kv_type, rpc=rpc, head=head, memory=memory)
        request = Request(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, system=system)
        chat_command.chat(opts, request, max_tokens, _chat_settings(reasoning_format, chat_template))


# ---------------------------------------------------------------------------------------------
# serve


@app.command(
    epilog=_examples(
        "specrun serve",
        "specrun serve --target qwen2.5-14b --port 8000",
        "SPECRUN_API_KEY=secret specrun serve --host 0.0.0.0 --cors https://chat.example.org",
        note=(
            "OpenAI-compatible: GET /health, GET /v1/models, GET /props, POST /v1/chat/completions, POST /v1/completions.",
            "Ollama's API beside it: /api/chat, /api/generate, /api/tags, /api/show, /api/version, /api/ps.",
            "Point a client at http://127.0.0.1:8080/v1 (any API key unless --api-key is set).",
        ),
    )
)
def serve(
    host: Annotated[str, typer.Option("--host", help="Address to listen on (another than 127.0.0.1 exposes the model: set an API key).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", min=0, max=65535, help="Port to listen on (0: any free one).")] = 8080,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="SPECRUN_API_KEY", show_envvar=True, help="Require this key (Authorization: Bearer KEY) on every /v1 route.")] = None,
    cors: Annotated[Optional[list[str]], typer.Option("--cors", metavar="ORIGIN", help="Allow browser pages from this origin (repeatable; * for any). Off by default: requests carrying another Origin get 403.")] = None,
    allow_host: Annotated[Optional[list[str]], typer.Option("--allow-host", metavar="NAME", help="Also answer requests sent to this host name (repeatable; * for any). Without an API key only localhost, this machine's name, the --host name and addresses are answered (DNS rebinding).")] = None,
    read_timeout: Annotated[float, typer.Option("--read-timeout", min=0.1, help="Seconds a client has to send a whole request (and an idle connection stays open); slower ones are closed.")] = 30.0,
    queue_size: Annotated[int, typer.Option("--queue-size", min=1, help="Requests that may wait while the server is busy; more get 503 with Retry-After.")] = 32,
    parallel: ParallelOpt = None,
    throughput: ThroughputOpt = False,
    reasoning_format: ReasoningFormatOpt = "auto",
    chat_template: ChatTemplateOpt = None,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    gpu_layers: GpuLayersOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    mmap: MmapOpt = None,
    flash_attn: FlashAttnOpt = None,
    kv_type: KvTypeOpt = None,
    kv_split: KvSplitOpt = False,
    rpc: RpcOpt = None,
    head: HeadOpt = None,
    ctx_size: AutoCtxOpt = None,
    threads: ThreadsOpt = None,
    budget: BudgetOpt = None,
    depth: DepthOpt = None,
    no_spec: NoSpecOpt = False,
    lookup: LookupOpt = None,
    memory: MemoryOpt = False,
    reproducible: Annotated[bool, typer.Option("--reproducible", help="Decode every request as generate --reproducible does: the same answer whatever else runs (passes of its own from a fresh prefill; greedy: plain decoding's answer bit for bit), at plain decoding's speed, or in greedy chains where the target's chains measure as one-token passes at start (a build without llamafile; a Q4_1 target with --kv-type q8_0). A request cannot turn it off.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (chat UIs, editors, scripts)."""
    _setup_logging(verbose)
    with _user_errors():
        try:
            from specrun.server.serve import ServerSettings, serve as run_server
        except ModuleNotFoundError as e:
            if e.name not in ("fastapi", "uvicorn", "pydantic", "starlette"):
                raise
            raise SpecrunError(f"`specrun serve` needs the {e.name} package, part of a normal install: pip install --upgrade specrun") from None
        opts = _run_options(target, draft, gpu_layers, ctx_size, threads, budget, depth, no_spec, lookup, gpu_memory=gpu_memory, mmap=mmap, flash_attn=flash_attn, kv_type=kv_type, rpc=rpc, head=head, parallel=parallel, memory=memory, memory_scope=api_key, throughput=throughput, kv_split=kv_split)
        if api_key is not None and not api_key.strip():
            raise UsageError("--api-key (or SPECRUN_API_KEY) is empty: give a key, or leave it out to serve without one")
        settings = ServerSettings(api_key=api_key, cors_origins=tuple(cors or ()), verbose=verbose, reproducible=reproducible,
                                  allowed_hosts=(*(allow_host or ()), host), read_timeout_s=read_timeout)
        run_server(opts, host, port, settings, queue_size, _chat_settings(reasoning_format, chat_template))


def _chat_settings(reasoning_format: str, chat_template: Path | None):
    from specrun.chat.reasoning import ChatSettings, normalize_format
    from specrun.inputs import option_file

    try:
        fmt = normalize_format(reasoning_format)
    except ValueError as e:
        raise UsageError(f"--reasoning-format: {e}") from None
    return ChatSettings(reasoning_format=fmt, template=option_file(chat_template, "--chat-template"))


# ---------------------------------------------------------------------------------------------
# bench


@app.command(
    epilog=_examples(
        "specrun bench",
        "specrun bench --workload code --max-tokens 256",
        "specrun bench --budget 4 --budget 16 --budget 64 --json",
        "specrun bench --target qwen2.5-14b --prompts my_prompts.jsonl",
        "specrun bench --report --gpu-memory 8GiB > report.md",
        note=(
            "By workload (default): plain, draft tree, lookup and hybrid per prompt set, modes alternating.",
            "--budget/--width/--children: plain vs trees of each size instead.",
            "A prompts file holds one prompt per line, or JSONL lines {\"prompt\": \"...\"} for multi-line prompts.",
        ),
    )
)
def bench(
    budgets: Annotated[Optional[list[int]], typer.Option("--budget", "-b", min=1, max=2048, help="Tree budget to measure (repeatable).")] = None,
    workload: Annotated[Optional[str], typer.Option("--workload", "-w", help="Built-in prompt set: chat, code, rewrite or all  [default: all].", show_default=False)] = None,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="File of prompts: one per line, or JSONL {\"prompt\": ...} (default: the built-in sets).")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", min=1, help="Tokens per prompt.")] = 128,
    depth: DepthOpt = None,
    width: Annotated[Optional[int], typer.Option("--width", min=1, max=256, help="Tree nodes the draft expands per pass (default: the tuned tree's; 1 with --children 1 is a chain).")] = None,
    children: Annotated[Optional[int], typer.Option("--children", min=1, max=256, help="Children per expanded tree node (default: the tuned tree's).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per row on stdout (with --report: the whole report).")] = False,
    report: Annotated[bool, typer.Option("--report", help="One shareable Markdown report: devices, build, layer placement, cost per pass up to the largest tree (--budget), plain and drafter speeds per workload, tune's choice.")] = False,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    gpu_layers: GpuLayersOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    mmap: MmapOpt = None,
    flash_attn: FlashAttnOpt = None,
    kv_type: KvTypeOpt = None,
    rpc: RpcOpt = None,
    head: HeadOpt = None,
    ctx_size: CtxOpt = 4096,
    threads: ThreadsOpt = None,
    lookup: LookupOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Measure plain vs speculative decoding tokens/s on the same prompts."""
    _setup_logging(verbose)
    with _user_errors():
        from specrun.commands import bench as bench_command

        opts = _run_options(target, draft, gpu_layers, ctx_size, threads, None, depth, False, lookup, gpu_memory=gpu_memory, mmap=mmap, flash_attn=flash_attn, kv_type=kv_type, rpc=rpc, head=head)
        if report:
            from specrun.commands import bench_report

            bench_report.bench_report(opts, budgets, workload or "all", prompts, max_tokens, as_json)
            return
        bench_command.bench(opts, budgets, prompts, max_tokens, as_json, width=width, children=children, workload=workload)


# ---------------------------------------------------------------------------------------------
# tune


@app.command(
    epilog=_examples(
        "specrun tune",
        "specrun tune --target qwen2.5-14b --draft qwen2.5-0.5b",
        "specrun tune --quick --json",
        "specrun tune --show",
        "specrun tune --plot curves.png",
    )
)
def tune(
    quick: Annotated[bool, typer.Option("--quick", help="Fewer measurements: a rougher profile in a fraction of the time.")] = False,
    show: Annotated[bool, typer.Option("--show", help="Show the stored profile for this pair instead of measuring.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the profile as JSON on stdout.")] = False,
    plot: Annotated[Optional[Path], typer.Option("--plot", metavar="FILE", help="Save cost and acceptance curves as an image (needs matplotlib).")] = None,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    gpu_layers: GpuLayersOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    mmap: MmapOpt = None,
    flash_attn: FlashAttnOpt = None,
    kv_type: KvTypeOpt = None,
    rpc: RpcOpt = None,
    head: HeadOpt = None,
    ctx_size: CtxOpt = 4096,
    threads: ThreadsOpt = None,
    budget: BudgetOpt = None,
    lookup: LookupOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Profile this machine with a target/draft pair and store the fastest tree settings."""
    _setup_logging(verbose)
    with _user_errors():
        try:
            from specrun.commands import tune as tune_command
        except ModuleNotFoundError as e:
            if e.name not in ("specrun.tuning", "specrun.commands.tune"):
                raise
            raise SpecrunError(f"`specrun tune` is not available in this build (the {e.name} module is missing)") from None
        opts = _run_options(target, draft, gpu_layers, ctx_size, threads, budget, None, False, lookup, gpu_memory=gpu_memory, mmap=mmap, flash_attn=flash_attn, kv_type=kv_type, rpc=rpc, head=head)
        tune_command.run_tune(opts, quick=quick, show=show, as_json=as_json, plot=plot)


# ---------------------------------------------------------------------------------------------
# plan


@app.command(
    epilog=_examples(
        "specrun plan",
        "specrun plan --target qwen2.5-14b --json",
        "specrun plan --target qwen2.5-14b --gpu 'RTX 4060=8GiB' --ram-free 24GiB",
    )
)
def plan(
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    gpu: Annotated[Optional[list[str]], typer.Option("--gpu", metavar="NAME=FREE[/TOTAL]", help="Plan for this GPU instead of the ones found (repeatable), e.g. 'RTX 4060=8GiB'.")] = None,
    ram_free: Annotated[Optional[str], typer.Option("--ram-free", metavar="SIZE", help="Plan for this much free RAM, e.g. 24GiB.")] = None,
    parallel: Annotated[int, typer.Option("--parallel", min=1, max=64, help="Plan for this many requests decoding together (as `specrun serve --parallel`).")] = 1,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    gpu_layers: GpuLayersOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    mmap: MmapOpt = None,
    flash_attn: FlashAttnOpt = None,
    kv_type: KvTypeOpt = None,
    kv_split: KvSplitOpt = False,
    rpc: RpcOpt = None,
    head: HeadOpt = None,
    ctx_size: AutoCtxOpt = None,
    threads: ThreadsOpt = None,
    budget: BudgetOpt = None,
    depth: DepthOpt = None,
    no_spec: NoSpecOpt = False,
    lookup: LookupOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Show what a run would load and where (files, tree, GPU layers, memory), without loading weights."""
    _setup_logging(verbose)
    with _user_errors():
        from specrun.commands import plan as plan_command

        opts = _run_options(target, draft, gpu_layers, ctx_size, threads, budget, depth, no_spec, lookup, gpu_memory=gpu_memory, mmap=mmap, flash_attn=flash_attn, kv_type=kv_type, rpc=rpc, head=head, parallel=parallel, kv_split=kv_split)
        plan_command.plan(opts, as_json, gpu, ram_free)


# ---------------------------------------------------------------------------------------------
# worker


@app.command(epilog=_examples("specrun worker --host 0.0.0.0 --port 50052 --threads 8 --cache",
                              "specrun serve --target qwen2.5-72b --rpc 192.168.1.20:50052   # on the machine that runs the model"))
def worker(
    host: Annotated[str, typer.Option("--host", help="IPv4 address to listen on (another than 127.0.0.1 lets other machines use this one's devices: a trusted network only).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", min=1, max=65535, help="Port to listen on.")] = RPC_DEFAULT_PORT,
    threads: ThreadsOpt = None,
    device: Annotated[Optional[list[str]], typer.Option("--device", metavar="NAME", help="Serve this device, e.g. CUDA0 or CPU (repeatable; default: this machine's GPUs, else its CPU).")] = None,
    cache: WorkerCacheOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Serve this machine's devices to another machine's specrun (--rpc HOST:PORT) over llama.cpp's RPC backend."""
    _setup_logging(verbose)
    with _user_errors():
        from specrun.commands import worker as worker_command
        worker_command.worker(host, port, threads, device or [], cache)


# ---------------------------------------------------------------------------------------------
# pull and models


@app.command(
    epilog=_examples(
        "specrun pull qwen2.5-14b qwen2.5-0.5b",
        "specrun pull hf:bartowski/Llama-3.2-1B-Instruct-GGUF/Llama-3.2-1B-Instruct-Q4_K_M.gguf",
        "HF_TOKEN=hf_... specrun pull llama3.1-8b",
        "specrun pull --force qwen2.5-14b     # fetch again, e.g. after a checksum mismatch",
    )
)
def pull(
    models: Annotated[list[str], typer.Argument(help="Model aliases (see `specrun models`) or hf:owner/repo/file.gguf.", show_default=False)],
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Fetch again even if present; the old file is replaced only once the new copy verifies.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Download (or build) models now; print each one's local path on stdout."""
    _setup_logging(verbose)
    with _user_errors():
        from specrun.commands import models as models_commands

        models_commands.pull(models, quiet, force)


@app.command(
    name="models",
    epilog=_examples(
        "specrun models",
        "specrun models --json | jq '.[] | select(.present) | .alias'",
    ),
)
def models_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON array instead of a table.")] = False,
    fit: Annotated[bool, typer.Option("--fit", help="Also plan each model on this machine: context, GPU layers, drafter (fetches a missing model's header, a few MB).")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """List the model aliases: family, size, quantization, whether present here, recommended draft."""
    _setup_logging(verbose)
    with _user_errors():
        from specrun.commands import models as models_commands

        models_commands.list_models(as_json, fit)


# ---------------------------------------------------------------------------------------------
# errors


@contextmanager
def _user_errors():
    """Turn errors into one line on stderr and an exit code (traceback only with --verbose).

    SpecrunError: its own code (2 for usage errors, 1 otherwise). Anything else is a bug: 1.
    """
    from specrun import ui

    try:
        yield
    except (typer.Exit, typer.Abort, typer.BadParameter):
        raise
    except SpecrunError as e:
        if _verbose:
            traceback.print_exc()
        ui.error(str(e))
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        ui.dim("interrupted")
        raise typer.Exit(130) from None
    except BrokenPipeError:
        ui.silence_stdout()
        raise typer.Exit(0) from None
    except Exception as e:
        if _verbose:
            traceback.print_exc()
            ui.error(f"unexpected {type(e).__name__}: {e}")
        else:
            ui.error(f"unexpected {type(e).__name__}: {e} (a bug in specrun; --verbose shows the traceback)")
        raise typer.Exit(1) from None


def main() -> None:
    """Console-script entry point."""
    app()
