"""The `specrun` command line. Commands parse options, call one function, and print via ui.py.

Heavy modules (llama_cpp, numpy work) are imported inside the commands, so `specrun --help`
starts instantly.
"""

from __future__ import annotations

import logging
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer

from specrun import __version__
from specrun.errors import SpecrunError, UsageError

app = typer.Typer(
    name="specrun",
    help="Fast local LLM decoding with speculative draft trees on llama.cpp.\n\n"
    "Examples:\n\n"
    "  specrun generate \"Write a haiku about the sea.\"\n\n"
    "  specrun chat --target qwen-14b --draft qwen-0.5b\n\n"
    "  specrun tune --target qwen-14b",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)

# ---- options shared by chat, generate, bench and tune (declared once) ----
TargetOpt = Annotated[Optional[str], typer.Option("--target", "-t", help="Target model: alias, .gguf path or hf:owner/repo/file.gguf (default: the offline demo pair).")]
DraftOpt = Annotated[Optional[str], typer.Option("--draft", "-d", help="Draft model (default: the target family's recommended draft).")]
GpuLayersOpt = Annotated[Optional[int], typer.Option("--gpu-layers", help="Target layers to put on the GPU (default: planned from free memory).")]
CtxOpt = Annotated[int, typer.Option("--ctx-size", "-c", min=64, help="Context size in tokens.")]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", min=1, help="CPU threads (default: all cores).")]
BudgetOpt = Annotated[Optional[int], typer.Option("--budget", "-b", min=1, max=2048, help="Draft tree size in nodes (default: tuned profile).")]
DepthOpt = Annotated[Optional[int], typer.Option("--depth", min=1, max=256, help="Maximum draft tree depth.")]
NoSpecOpt = Annotated[bool, typer.Option("--no-spec", help="Plain decoding, no draft model.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Show llama.cpp logs, chosen settings and tracebacks.")]

_verbose = False


def _setup_logging(verbose: bool) -> None:
    global _verbose
    _verbose = verbose
    level = logging.DEBUG if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(name)s: %(message)s", stream=sys.stderr, force=True)
    # llama.cpp's own chatter stays silent unless asked for.
    logging.getLogger("specrun.llama").setLevel(logging.INFO if verbose else logging.CRITICAL)


def _run_options(target, draft, gpu_layers, ctx_size, threads, budget, depth, no_spec, quiet=False):
    from specrun.runner import RunOptions

    return RunOptions(
        target=target, draft=draft, gpu_layers=gpu_layers, ctx_size=ctx_size, threads=threads,
        budget=budget, depth=depth, no_spec=no_spec, quiet=quiet,
    )


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


def _read_prompt(prompt: str | None, file: Path | None) -> str:
    if prompt is not None and file is not None:
        raise UsageError("give the prompt either as an argument or with --file, not both")
    if file is not None:
        try:
            return file.read_text(encoding="utf-8")
        except OSError as e:
            raise UsageError(f"cannot read prompt file {file}: {e.strerror}") from None
    if prompt is not None:
        return prompt
    if not sys.stdin.isatty():
        return sys.stdin.read()
    raise UsageError("no prompt: pass it as an argument, with --file, or on stdin")


@app.command(
    epilog="Examples:\n\n"
    "  specrun generate \"Explain KV caches in two sentences.\"\n\n"
    "  cat prompt.txt | specrun generate --max-tokens 200 --stats\n\n"
    "  specrun generate --raw --no-spec \"def fib(n):\"\n\n"
    "  cat requests.jsonl | specrun generate --jsonl"
)
def generate(
    prompt: Annotated[Optional[str], typer.Argument(help="The prompt (default: read stdin).")] = None,
    file: Annotated[Optional[Path], typer.Option("--file", "-f", help="Read the prompt (or JSONL requests) from a file.")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", min=1, help="Maximum tokens to generate.")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", "--temp", min=0.0, help="0 = greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", min=0, help="Keep the k likeliest tokens (0 = off).")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling mass (1 = off).")] = 1.0,
    min_p: Annotated[float, typer.Option("--min-p", min=0.0, max=1.0, help="Drop tokens below min-p x the best probability.")] = 0.0,
    seed: Annotated[Optional[int], typer.Option("--seed", min=0, help="Random seed for sampling.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop when this text appears (repeatable).")] = None,
    chat: Annotated[bool, typer.Option("--chat/--raw", help="Wrap the prompt in the model's chat template.")] = True,
    system: Annotated[Optional[str], typer.Option("--system", help="System prompt (chat mode).")] = None,
    stats: Annotated[bool, typer.Option("--stats", help="Print a summary on stderr.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object with text and stats.")] = False,
    jsonl: Annotated[bool, typer.Option("--jsonl", help="Read JSON requests line by line; write one JSON result per line.")] = False,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    gpu_layers: GpuLayersOpt = None,
    ctx_size: CtxOpt = 4096,
    threads: ThreadsOpt = None,
    budget: BudgetOpt = None,
    depth: DepthOpt = None,
    no_spec: NoSpecOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Generate text for a prompt (argument, --file or stdin), streaming it to stdout."""
    _setup_logging(verbose)
    with _user_errors():
        from specrun import commands

        opts = _run_options(target, draft, gpu_layers, ctx_size, threads, budget, depth, no_spec)
        request = commands.Request(
            max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            seed=seed, stop=tuple(stop or ()), chat=chat, system=system,
        )
        if jsonl:
            if prompt is not None:
                raise UsageError("--jsonl reads requests from stdin or --file, not from an argument")
            commands.generate_jsonl(opts, request, file)
            return
        text = _read_prompt(prompt, file)
        commands.generate_one(opts, request, text, show_stats=stats, as_json=as_json)


# ---------------------------------------------------------------------------------------------
# bench


@app.command(
    epilog="Examples:\n\n"
    "  specrun bench\n\n"
    "  specrun bench --budget 4 --budget 16 --budget 64 --json\n\n"
    "  specrun bench --target qwen-14b --prompts my_prompts.txt"
)
def bench(
    budgets: Annotated[Optional[list[int]], typer.Option("--budget", "-b", min=1, max=2048, help="Tree budget to measure (repeatable).")] = None,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="File with one prompt per line (default: built-in chat/code/prose set).")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", min=1, help="Tokens per prompt.")] = 128,
    depth: DepthOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per budget on stdout.")] = False,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    gpu_layers: GpuLayersOpt = None,
    ctx_size: CtxOpt = 4096,
    threads: ThreadsOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Measure plain vs speculative decoding tokens/s on the same prompts."""
    _setup_logging(verbose)
    with _user_errors():
        from specrun import commands

        opts = _run_options(target, draft, gpu_layers, ctx_size, threads, None, depth, False)
        commands.bench(opts, budgets or [4, 16, 64], prompts, max_tokens, as_json)


@contextmanager
def _user_errors():
    """Turn a SpecrunError into one line on stderr and its exit code (traceback only with --verbose)."""
    from specrun import ui

    try:
        yield
    except SpecrunError as e:
        if _verbose:
            traceback.print_exc()
        ui.error(str(e))
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        ui.dim("interrupted")
        raise typer.Exit(130) from None
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): stop quietly.
        sys.stderr.close()
        raise typer.Exit(0) from None


def main() -> None:
    """Console-script entry point."""
    app()
