"""The options the commands share, declared once (cli.py's commands take them by these names)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer


# ---- options shared by chat, generate, bench and tune (declared once) ----
TargetOpt = Annotated[Optional[str], typer.Option("--target", "-t", help="Target model: alias, .gguf path or hf:owner/repo/file.gguf (default: the offline demo pair).")]
DraftOpt = Annotated[Optional[str], typer.Option("--draft", "-d", help="Draft model (default: the target family's recommended draft), or 'lookup': trees from the session's own text, no draft model, or 'mtp': chains from the target's own MTP layers (the default for a target that carries them).")]
GpuLayersOpt = Annotated[Optional[int], typer.Option("--gpu-layers", min=0, help="Target layers to put on the GPU (default: planned from free GPU memory).")]
GpuMemoryOpt = Annotated[Optional[str], typer.Option("--gpu-memory", metavar="SIZE", help="Use at most this much of each GPU, e.g. 8GiB: a big card stands in for a smaller one, the rest of the model in RAM.")]
MmapOpt = Annotated[Optional[bool], typer.Option("--mmap/--no-mmap", show_default=False, help="Map the target's file, or read it into memory: read, its layers left in RAM sit in the GPU's pinned memory, which passes of 32 tokens and more copy to the GPU several times faster  [default: read where the target's layers are split between a GPU and RAM, else mapped].")]
FlashAttnOpt = Annotated[Optional[str], typer.Option("--flash-attn", metavar="auto|on|off", show_default=False, help="The target's flash attention. On a CPU, off makes tree passes of 8 tokens and more cheaper from contexts of about 600 tokens, 1.4x to 3x by the CPU (one agent or long conversation at a time; `specrun bench --report` measures it here), prompts 13-28% dearer, and every pass dearer beside other requests' long texts (docs/benchmarks.md)  [default: auto (llama.cpp's: on wherever its kernels run), off on a batch-invariant build, or, one request at a time on a CPU, as measured here: by `specrun tune` on the target, or at its first start by a probe of this CPU's attention at its shape, where the target rounds alike without it].")]
KvTypeOpt = Annotated[Optional[str], typer.Option("--kv-type", metavar="f16|q8_0|q4_0", show_default=False, help="The target's KV cache cells, keys and values (llama.cpp's --cache-type-k/-v): q8_0 holds a context in about half the memory of f16, q4_0 in about a quarter, with flash attention on. On a CPU a quantized cache's attention rounds a token alike wherever its cells sit (in order) and however many tokens its pass holds; prompts of 1,500-3,000 tokens evaluate 2.1-2.6x slower (docs/exactness.md)  [default: f16].")]
KvSplitOpt = Annotated[bool, typer.Option("--kv-split", help="With several requests decoding together (--parallel), each its own KV cache in the target's context, as llama-server's slots (llama.cpp's kv_unified off): a request's cells stay in its own order whatever the others do, so its greedy answer does not move with them where the target's rows round alike in any pass (a Q4_1 target with --kv-type q8_0; docs/exactness.md). Requests then verify chains, not trees.")]
CtxOpt = Annotated[int, typer.Option("--ctx-size", "-c", min=64, help="Context size in tokens.")]
AutoCtxOpt = Annotated[Optional[int], typer.Option("--ctx-size", "-c", min=64, show_default=False, help="Context size in tokens  [default: the model's trained context, lowered to what memory holds].")]
ReasoningFormatOpt = Annotated[str, typer.Option("--reasoning-format", help="Reasoning models' thinking: auto (apart: reasoning_content in the API, dimmed on stderr in chat) or none (left in the answer).")]
ChatTemplateOpt = Annotated[Optional[Path], typer.Option("--chat-template", metavar="FILE", help="Jinja chat template to use instead of the model's own.")]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", min=1, help="CPU threads (default: all cores).")]
BudgetOpt = Annotated[Optional[int], typer.Option("--budget", "-b", min=1, max=2048, help="Draft tree size in nodes (default: tuned profile).")]
DepthOpt = Annotated[Optional[int], typer.Option("--depth", min=1, max=256, help="Maximum draft tree depth.")]
NoSpecOpt = Annotated[bool, typer.Option("--no-spec", help="Plain decoding, no draft model.")]
LookupOpt = Annotated[Optional[bool], typer.Option("--lookup/--no-lookup", help="Add lookup branches (continuations of earlier occurrences in the session's text) to the draft model's trees  [default: on with a draft model; --lookup also drafts from the text where no draft model runs].", show_default=False)]
MemoryOpt = Annotated[bool, typer.Option("--memory", help="Keep the memory of answers (earlier answers draft later ones) in the cache folder: loaded at start, saved at the end, per target model (and API key).")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Show llama.cpp logs, chosen settings and tracebacks.")]
WorkerCacheOpt = Annotated[bool, typer.Option("--cache/--no-cache", help="Keep the weights clients send (tensors over 10 MB, in specrun's cache folder, 'worker'), so that a model loaded again sends only their hashes: disk for network time.")]
ParallelOpt = Annotated[Optional[int], typer.Option("--parallel", min=1, max=64, help="Requests decoded together, their target passes shared (default: as many as fit at the context one request gets, 4 at most).")]
ThroughputOpt = Annotated[bool, typer.Option("--throughput", help="With requests decoding together: a prompt is evaluated in the passes of the others' steps, as llama-server does, not in passes of its own; faster with many clients, but an answer may part from the same request alone at a near-tie (docs/exactness.md).")]
HeadOpt = Annotated[Optional[str], typer.Option("--head", metavar="auto|here|workers", show_default=False, help="With --rpc: where the target's output layer computes. workers (llama.cpp's placement, with the last layers) sends a row of logits back over the network for every token a pass verifies (n_vocab floats: 192 KiB for the demo pair, 594 KiB for a 152k vocabulary); here computes it on this machine's CPU from hidden states (n_embd floats a token), reading its whole matrix every pass; auto measures both at start (the rows of logits over the link against the layer's product on this CPU) and takes the faster (docs/rpc.md)  [default: auto].")]
RpcOpt = Annotated[Optional[list[str]], typer.Option("--rpc", metavar="HOST:PORT[,...]", envvar="SPECRUN_RPC", show_envvar=True, help="Spread the target's layers over these RPC workers too (`specrun worker` on each machine); the draft stays here.")]

# ---- sampling options shared by chat and generate ----
TemperatureOpt = Annotated[float, typer.Option("--temperature", "--temp", min=0.0, help="Sampling temperature; 0 = greedy.")]
TopKOpt = Annotated[int, typer.Option("--top-k", min=0, help="Keep the k likeliest tokens (0 = off).")]
def _top_p_range(value: float) -> float:
    """Accept exactly what sampling accepts: 0 < p <= 1 (a nucleus of no mass keeps nothing)."""
    if not 0.0 < value <= 1.0:
        raise typer.BadParameter(f"{value:g} is not in the range 0<x<=1.")
    return value


TopPOpt = Annotated[float, typer.Option("--top-p", callback=_top_p_range, help="Nucleus sampling mass, 0 < p <= 1 (1 = off).")]
MinPOpt = Annotated[float, typer.Option("--min-p", min=0.0, max=1.0, help="Drop tokens below min-p x the best probability.")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", min=0, help="Random seed for sampling (default: a fresh one each run).")]
PresenceOpt = Annotated[float, typer.Option("--presence-penalty", min=-2.0, max=2.0, help="Subtract this from tokens already generated (OpenAI's presence_penalty).")]
FrequencyOpt = Annotated[float, typer.Option("--frequency-penalty", min=-2.0, max=2.0, help="Subtract this per time a token was generated (OpenAI's frequency_penalty).")]
RepeatOpt = Annotated[float, typer.Option("--repeat-penalty", min=0.0, help="llama.cpp's repeat penalty on the last 64 generated tokens; 1 = off.")]
SystemOpt = Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt (chat mode).")]


def examples(*lines: str, note: tuple[str, ...] = ()) -> str:
    """Return an epilog of example command lines, kept as written (click rewraps other paragraphs)."""
    text = "Examples:\n\n\b\n" + "\n".join(f"  {line}" for line in lines)
    if note:
        text += "\n\n\b\n" + "\n".join(note)
    return text
