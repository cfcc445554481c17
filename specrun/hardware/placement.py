"""Where the weights go: GPU layers for the target and the draft, from the offload planner.

Reads the models' shapes with vocab-only loads (no weights), asks `offload.plan_offload` how many
target layers fit on the GPUs next to the draft, the KV cache and the largest tree, and returns
llama.cpp's n_gpu_layers for each. Without a GPU everything stays in RAM and nothing is read.
Where the target's output layer would go to an RPC worker, whether it computes faster here is
measured (`head_pays_here`).
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from specrun import engine, sysinfo
from specrun.engine import rpc
from specrun.engine.devices import GPU_KINDS
from specrun.errors import ModelFileError
from specrun.hardware import offload

log = logging.getLogger("specrun")

# llama.cpp's own figures for a run's contexts at n_ctx cells: (target's, draft's), None where unknown.
Measured = Callable[[int], "tuple[offload.ContextBytes | None, offload.ContextBytes | None]"]

_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def weight_bytes(path: Path) -> int:
    """Return the bytes of a GGUF's weights, every shard of a split file (what llama.cpp maps)."""
    return sum(engine.gguf_data_bytes(shard) or shard.stat().st_size for shard in shards(path))


def shards(path: Path) -> list[Path]:
    """Return the files of a GGUF: itself, or every sibling shard of a split file."""
    match = _SHARD.search(path.name)
    if not match:
        return [path]
    count = int(match.group(2))
    stem = path.name[: match.start()]
    return [path.with_name(f"{stem}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def total_file_bytes(path: Path) -> int:
    """Return the size of a GGUF, adding every sibling shard of a split file."""
    return sum(shard.stat().st_size for shard in shards(path))


def model_size(path: Path) -> offload.ModelSize:
    """Return the planner's view of a model file, read from its metadata (no weights loaded)."""

    with engine.Model(path, vocab_only=True) as model:
        arch = model.architecture
        # A vocab-only load leaves the shape fields empty: read them from the metadata.
        n_embd = _meta_int(model, f"{arch}.embedding_length", 0)
        n_layer = _meta_int(model, f"{arch}.block_count", 0)
        n_vocab = model.n_vocab
        if not n_embd or not n_layer:
            raise ModelFileError(f"{path}: GGUF metadata lacks {arch}.embedding_length/block_count")
        n_head = _meta_int(model, f"{arch}.attention.head_count", 1)
        n_head_kv = _meta_int(model, f"{arch}.attention.head_count_kv", n_head)
        # llama.cpp's head size is the key/value length where the file states it (Gemma 3: 256
        # where n_embd / n_head is 160), else n_embd / n_head
        key_length = _meta_int(model, f"{arch}.attention.key_length", n_embd // max(n_head, 1))
        value_length = _meta_int(model, f"{arch}.attention.value_length", key_length)
        n_ff = _meta_int(model, f"{arch}.feed_forward_length", 0)
        n_ctx_train = _meta_int(model, f"{arch}.context_length", 0)
    file_bytes = total_file_bytes(Path(path))
    _, tensors = engine.gguf_header_facts(Path(path))
    if tensors and not _SHARD.search(Path(path).name):
        return size_from_tensors(tensors, file_bytes, n_layer, n_embd=n_embd, n_vocab=n_vocab, n_head=n_head,
                                 n_head_kv=n_head_kv, n_ff=n_ff, n_ctx_train=n_ctx_train,
                                 key_length=key_length, value_length=value_length)
    # Bytes per weight from a parameter estimate: attention ~ (2 + 2*kv/heads) n_embd^2, MLP 3 n_embd n_ff.
    per_layer_params = (2 + 2 * n_head_kv / max(n_head, 1)) * n_embd * n_embd + 3 * n_embd * max(n_ff, 4 * n_embd)
    params = n_layer * per_layer_params + 2 * n_vocab * n_embd
    bytes_per_weight = file_bytes / params
    embedding = int(n_vocab * n_embd * bytes_per_weight)
    return offload.ModelSize.from_totals(
        file_bytes, n_layer, n_embd=n_embd, n_vocab=n_vocab, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=key_length, n_ff=n_ff, input_bytes=embedding, output_bytes=min(embedding, file_bytes // 4), n_ctx_train=n_ctx_train,
    )


_BLOCK = re.compile(r"^blk\.(\d+)\.")
# A layer's routed experts (llama.cpp's names; the pattern its own fit moves to RAM).
_EXPERTS = re.compile(r"^blk\.\d+\.ffn_(up|down|gate_up|gate)_(ch|)exps")
# Tensors of the output head (the rest outside blk.* is the input side: embeddings and norms).
_OUTPUT = ("output.weight", "output.bias", "output_norm.weight", "output_norm.bias")


def size_from_tensors(tensors: dict[str, int], file_bytes: int, n_layer: int, **shape: int) -> offload.ModelSize:
    """Return the planner's view from the GGUF header's own tensor sizes.

    Exact where the parameter estimate is not: a mixture-of-experts layer holds all its experts
    (`ffn_*_exps`, most of the file in gpt-oss or Qwen3.5-MoE) wherever the layer is placed, and
    its largest tensor is a whole stack of experts. Layers past n_layer (MTP / next-token heads)
    count with the last layer.
    """
    layers = [0] * n_layer
    experts = [0] * n_layer
    input_bytes = output_bytes = largest = 0
    for name, size in tensors.items():
        match = _BLOCK.match(name)
        if match:
            layer = min(int(match.group(1)), n_layer - 1)
            layers[layer] += size
            if _EXPERTS.match(name):
                experts[layer] += size
            largest = max(largest, size)
        elif name in _OUTPUT:
            output_bytes += size
        else:
            input_bytes += size
    tied = 0
    if "output.weight" not in tensors:  # tied: llama.cpp keeps a copy of the embedding for the head
        tied = tensors.get("token_embd.weight", 0)
        output_bytes += tied
    n_head = shape.pop("n_head")
    n_head_kv = shape.pop("n_head_kv")
    head_dim = shape["n_embd"] // max(n_head, 1)
    key_length = shape.pop("key_length", head_dim)
    value_length = shape.pop("value_length", key_length)
    return offload.ModelSize(
        file_bytes=file_bytes, layer_bytes=tuple(layers), input_bytes=input_bytes, output_bytes=output_bytes,
        n_head=n_head, n_embd_k_gqa=n_head_kv * key_length, n_embd_v_gqa=n_head_kv * value_length,
        largest_tensor_bytes=largest, expert_bytes=tuple(experts) if any(experts) else (), tied_bytes=tied, **shape,
    )


def _meta_int(model, key: str, default: int) -> int:
    """Return an integer metadata value (arrays: their largest element)."""
    value = model.meta(key)
    if not value:
        return default
    numbers = [int(float(v)) for v in re.findall(r"-?\d+(?:\.\d+)?", value)]
    return max(numbers) if numbers else default



def _measured(measured: Measured | None, n_ctx: int) -> tuple[offload.ContextBytes | None, offload.ContextBytes | None]:
    return measured(n_ctx) if measured is not None else (None, None)


def gpus_of(devices) -> tuple[offload.Device, ...]:
    """Return the planner's view of the GPUs among llama.cpp's devices (engine.DeviceInfo-like):
    RPC workers' devices first, as a target spread over hosts offloads to them (engine.Model)."""
    gpus = [offload.Device(d.name, d.free_bytes, d.total_bytes, getattr(d, "host", ""))
            for d in devices if d.kind in GPU_KINDS]
    return tuple(sorted(gpus, key=lambda d: not d.host))


def plan(
    target: offload.ModelSize,
    draft: offload.ModelSize | None,
    gpus: Sequence[offload.Device],
    n_ctx: int,
    n_ubatch: int,
    override: int | None = None,
    ram_free_bytes: int | None = None,
    measured: Measured | None = None,
    kv_type: str | None = None,
    head_here: bool | None = False,
    head_rows: int = 1,
) -> offload.OffloadPlan:
    """Return where the target's layers and the draft go on these GPUs, for contexts of n_ctx
    cells whose forward passes hold up to n_ubatch tokens (the compute buffer grows with it);
    `measured(n_ctx)` gives llama.cpp's own context figures for both models (else the target's
    cache is estimated at `kv_type`'s bytes); `head_here`: --head here (offload.plan_offload),
    None: here where the output layer's slot goes to an RPC worker and `head_pays_here` for
    passes of `head_rows` tokens."""
    def placed_with(head: bool) -> offload.OffloadPlan:
        return offload.plan_offload(
            target, draft, list(gpus), sysinfo.ram_bytes()[1] if ram_free_bytes is None else ram_free_bytes,
            n_ctx, n_ubatch, gpu_layers_override=override, measured=_measured(measured, n_ctx), kv_type=kv_type,
            head_here=head,
        )

    placed = placed_with(bool(head_here))
    worker = head_worker(placed, gpus) if head_here is None else None
    if worker is not None and rpc.round_trip_s(worker) is not None:  # (a worker connected: measurable)
        here, why = head_pays_here(target, worker, head_rows)
        log.info("the output layer %s: %s", "here" if here else "on the worker", why)
        placed = replace(placed_with(True) if here else placed, head_why=why)
    if gpus:
        for warning in placed.warnings:
            log.warning("%s", warning)
        where = f"on {gpus[placed.draft_device].name}" if placed.draft_device is not None else "in RAM"
        log.info("placement: target %d of %d layers on %s, draft %s", placed.target_gpu_layers, placed.target_n_slots,
                 _devices_named(gpus), where)
    return placed


def _devices_named(gpus: Sequence[offload.Device]) -> str:
    """What the log calls the devices the target's layers go to: GPUs, RPC workers or both."""
    workers = sum(1 for d in gpus if d.host)
    if not workers:
        return "GPU"
    return "RPC workers" if workers == len(gpus) else "GPUs and RPC workers"


# Tokens a speculative pass verifies, as weighed when placing the output layer by measurement: a
# tree of the size passes over a network grow to (plain decoding weighs one).
HEAD_ROWS = 16
# The output layer's product is timed on a slice of its matrix of at most this many floats (64 MiB:
# more than a CPU's caches hold, so that the matrix is read from memory, as a whole layer is).
_HEAD_SLICE_FLOATS = 1 << 24


def head_worker(placed: offload.OffloadPlan, gpus: Sequence[offload.Device]) -> str | None:
    """Return the RPC worker the target's last offloaded slot (its output layer) went to, if it
    went to one."""
    holding = [device for device, n in zip(gpus, placed.target_tensor_split) if n]
    return (holding[-1].host or None) if holding else None


def head_pays_here(target: offload.ModelSize, worker: str, rows: int) -> tuple[bool, str]:
    """Return whether the target's output layer computes here sooner than a pass of `rows` tokens
    brings its rows of logits back from `worker`, and one line with both figures. The logits'
    trip is measured over the link (engine.rpc.fetch_s: rows x n_vocab floats, less the rows x
    n_embd floats of hidden states that cross it instead); the layer here is a product of its
    shape timed on this CPU in F32 (the matrix read once, then every row: a quantized layer
    reads less), the worker's own time for it taken as nothing."""
    hidden, logits = rows * target.n_embd * 4, rows * target.n_vocab * 4
    fetched = rpc.fetch_s(worker, (hidden, logits))
    link_s = max(0.0, fetched[logits] - fetched[hidden])
    here_s = head_seconds(target.n_embd, target.n_vocab, rows)
    why = (f"the logits of a {rows}-token pass take {link_s * 1e3:.1f} ms to come back from {worker}, "
           f"the output layer ~{here_s * 1e3:.1f} ms here")
    return link_s > here_s, why


@functools.lru_cache(maxsize=8)
def head_seconds(n_embd: int, n_vocab: int, rows: int, repeats: int = 3) -> float:
    """Return the seconds this CPU takes for an output layer's product over `rows` hidden states:
    the least of `repeats` timings of a slice of its F32 matrix, scaled to n_vocab columns (timed
    once a process)."""
    columns = max(1, min(n_vocab, _HEAD_SLICE_FLOATS // max(n_embd, 1)))
    matrix = np.full((n_embd, columns), 0.01, dtype=np.float32)
    hidden = np.full((rows, n_embd), 0.5, dtype=np.float32)
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.matmul(hidden, matrix)
        timings.append(time.perf_counter() - start)
    return min(timings) * n_vocab / columns


# A context chosen for the user is never below this (unless the model was trained for less), and
# moves in steps of this many cells: llama.cpp pads the KV cache to 256 cells anyway.
MIN_AUTO_CTX = 4096
AUTO_CTX_STEP = 256


def largest_context(
    target: offload.ModelSize,
    draft: offload.ModelSize | None,
    gpus: Sequence[offload.Device],
    n_ubatch: int,
    override: int | None = None,
    ram_free_bytes: int | None = None,
    measured: Measured | None = None,
    kv_type: str | None = None,
) -> tuple[int, str]:
    """Return the context to use when none is asked for, and why: the target's trained context,
    lowered (as llama.cpp's --fit does) until the plan fits without moving more target layers (or
    a MoE model's experts) off the GPUs than the plan for MIN_AUTO_CTX cells keeps there."""
    trained = target.n_ctx_train
    if trained <= 0:
        return MIN_AUTO_CTX, "the model does not say its trained context"
    floor = min(MIN_AUTO_CTX, trained)
    free = sysinfo.ram_bytes()[1] if ram_free_bytes is None else ram_free_bytes

    def placed(n_ctx: int) -> offload.OffloadPlan:
        return offload.plan_offload(target, draft, list(gpus), free, n_ctx, min(n_ubatch, n_ctx),
                                    gpu_layers_override=override, measured=_measured(measured, n_ctx), kv_type=kv_type)

    base = placed(floor)

    def holds(n_ctx: int) -> bool:
        p = placed(n_ctx)
        return (p.fits and p.target_gpu_layers >= base.target_gpu_layers and p.draft_device == base.draft_device
                and p.cpu_expert_layers <= base.cpu_expert_layers)

    if holds(trained):
        return trained, "the model's trained context"
    low, high = floor // AUTO_CTX_STEP, trained // AUTO_CTX_STEP  # in steps; `low` is taken as is
    while low < high:
        mid = (low + high + 1) // 2
        if holds(mid * AUTO_CTX_STEP):
            low = mid
        else:
            high = mid - 1
    n_ctx = max(floor, low * AUTO_CTX_STEP)
    return n_ctx, f"the model's trained context of {trained} tokens, lowered to what memory holds: {_trade(placed(trained), placed(n_ctx), trained, n_ctx)}"


def _trade(full: offload.OffloadPlan, chosen: offload.OffloadPlan, trained: int, n_ctx: int) -> str:
    """Return what the trained context would cost against the chosen one, e.g. "32768 tokens would
    keep 12 of 65 layer slots on the GPU; 16384 keep 65"."""
    if not full.fits:
        return f"{trained} tokens would not fit {'in RAM' if not full.ram_fits else 'on the GPU'}"
    slots = chosen.target_n_slots
    if full.cpu_expert_layers != chosen.cpu_expert_layers:
        return (f"{trained} tokens would keep the experts of {full.cpu_expert_layers} of {slots - 1} layers in RAM; "
                f"{n_ctx} keep {chosen.cpu_expert_layers}")
    return (f"{trained} tokens would keep {full.target_gpu_layers} of {slots} layer slots on the GPU"
            f"{'' if full.draft_device == chosen.draft_device else ' and move the draft'}; "
            f"{n_ctx} keep {chosen.target_gpu_layers}")


def cpu_only(files: Sequence[Path], ram_free_bytes: int | None = None,
             measured: Sequence[offload.ContextBytes | None] = ()) -> offload.OffloadPlan:
    """Return the plan for a machine without a GPU: everything in RAM, the weights as the files'
    tensor data (memory-mapped), the contexts as llama.cpp sizes them where `measured` (per file)
    says (else not counted)."""
    ram = offload.PlaceBytes("RAM", model=sum(weight_bytes(Path(f)) for f in files))
    for figures in measured:
        if figures is not None:
            ram = ram.plus(context=figures.context, compute=figures.compute, output=figures.output)
    free = sysinfo.ram_bytes()[1] if ram_free_bytes is None else ram_free_bytes
    return offload.OffloadPlan(
        target_gpu_layers=0, target_n_slots=0, target_tensor_split=(), draft_device=None, draft_gpu_layers=0,
        op_offload=False, device_bytes=(), device_limit_bytes=(), ram_bytes=ram.total,
        ram_limit_bytes=max(0, free - offload.DEFAULT_MARGIN_BYTES), overridden=False, warnings=(),
        breakdown=(ram,), measured=bool(measured) and measured[0] is not None,
    )


def gpu_layers(
    target_path: Path,
    draft_path: Path | None,
    n_ctx: int,
    n_ubatch: int,
    override: int | None = None,
    devices=None,
    ram_free_bytes: int | None = None,
) -> tuple[int, int]:
    """Return (target n_gpu_layers, draft n_gpu_layers) for these files on these devices."""
    if devices is None:
        devices = engine.list_devices()
    gpus = gpus_of(devices)
    if not gpus:
        return (override or 0), 0
    placed = plan(model_size(target_path), model_size(draft_path) if draft_path else None, gpus, n_ctx, n_ubatch,
                  override, ram_free_bytes)
    return placed.target_gpu_layers, (placed.draft_gpu_layers if placed.draft_device is not None else 0)
