"""Where the weights go: which target layers live on the GPU(s), which stay in RAM, and the draft.

A pure function of model sizes and free memory, decided before llama.cpp loads anything, so a
user with a GPU gets the most layers that fit instead of an out-of-memory error at load time.

llama.cpp's `n_gpu_layers` convention (src/llama-model.cpp, load_tensors): the model has
n_layer + 1 offloadable slots, the repeating layers 0..n_layer-1 and the output layer (output norm
and output matrix) as slot n_layer. `n_gpu_layers = g` puts the last g slots on the GPU(s): g = 1
offloads only the output layer, g = n_layer + 1 offloads everything. The input layer (token
embedding) always stays in RAM. With several GPUs, slot i_gpu_start + i goes to the first device
whose cumulative `tensor_split` share exceeds i / g; we pass per-device slot counts as
`tensor_split`, so the split is exactly the one planned here. All sizes are estimates with a
safety margin (the engine can still meet an allocation failure).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

MIB = 1024**2

# Kept free on every GPU and in RAM: CUDA/driver allocations that grow after we measure, memory
# fragmentation, and estimation error in the buffers below.
DEFAULT_MARGIN_BYTES = 512 * MIB

# The KV cache's bytes a key or value (--kv-type; ggml's blocks of 32: q8_0 an f16 scale and 32
# bytes, q4_0 a scale and 16), in cells rounded up to a multiple of 256.
KV_BYTES_PER_VALUE = {"f16": 2, "q8_0": 34 / 32, "q4_0": 18 / 32}
KV_CELL_PADDING = 256

# CUDA (and Metal, Vulkan, SYCL) run a matmul on RAM-resident weights on the GPU, copied over, from this many
# tokens a batch ("op offload": a 500-token tree pass then costs about a 1-token one); CUDA's own setting:
OP_OFFLOAD_MIN_BATCH = int(v) if (v := os.environ.get("GGML_OP_OFFLOAD_MIN_BATCH", "").strip()).isdigit() else 32
# Weights copied to the GPU for one stretch of offloaded ops: e.g. ffn_gate, ffn_up, ffn_down.
OP_OFFLOAD_COPIED_TENSORS = 3
# Without tensor sizes from the GGUF: the largest matrix of a layer (usually an FFN matrix, often
# at a higher-bit quant type in *_K_M files) is about this share of the layer.
LARGEST_TENSOR_SHARE = 0.35
# Without n_ff in the metadata: the FFN width of most dense models is below 4 * n_embd.
FFN_WIDTH_ESTIMATE = 4

FLOAT32_BYTES = 4

# CUDA multiplies quantized weights by at most this many tokens with its matrix-vector kernels and
# switches to matrix-matrix kernels above: one more step in t(n) wherever layers sit on the GPU.
CUDA_VECTOR_KERNEL_MAX_BATCH = 8


@dataclass(frozen=True)
class ModelSize:
    """The memory-relevant shape of a GGUF model.

    `layer_bytes[i]` are the weights of repeating layer i (tensors `blk.i.*`); `input_bytes` the
    token embedding (always in RAM); `output_bytes` the output norm and output matrix (the token
    embedding again when the model ties them: llama.cpp then keeps a copy on the output's device;
    `tied_bytes` of them, which take no memory of their own where the head stays in RAM: there it
    reads the embedding's own mapped bytes).
    """

    file_bytes: int
    layer_bytes: tuple[int, ...]
    input_bytes: int
    output_bytes: int
    n_embd: int
    n_vocab: int
    n_head: int
    n_embd_k_gqa: int  # key width per token per layer: n_head_kv * head_dim
    n_embd_v_gqa: int
    n_ff: int = 0  # FFN width; 0 = unknown, estimated as FFN_WIDTH_ESTIMATE * n_embd
    largest_tensor_bytes: int = 0  # largest single weight in a layer; 0 = unknown, estimated
    n_ctx_train: int = 0  # the context the model was trained for; 0 = unknown
    expert_bytes: tuple[int, ...] = ()  # per layer: its routed experts (ffn_*_exps); empty = a dense model
    tied_bytes: int = 0  # of output_bytes: the token embedding's copy for a tied head

    @property
    def n_layer(self) -> int:
        return len(self.layer_bytes)

    @classmethod
    def from_totals(
        cls,
        file_bytes: int,
        n_layer: int,
        *,
        n_embd: int,
        n_vocab: int,
        n_head: int,
        n_head_kv: int,
        head_dim: int | None = None,
        n_ff: int = 0,
        input_bytes: int,
        output_bytes: int,
        n_ctx_train: int = 0,
    ) -> ModelSize:
        """Spread what the file holds beyond input and output evenly over the layers."""
        head_dim = head_dim or n_embd // n_head
        per_layer, extra = divmod(file_bytes - input_bytes - output_bytes, n_layer)
        if per_layer <= 0:
            raise ValueError("input and output bytes leave nothing for the layers")
        layers = tuple(per_layer + (1 if i < extra else 0) for i in range(n_layer))
        return cls(
            file_bytes=file_bytes, layer_bytes=layers, input_bytes=input_bytes,
            output_bytes=output_bytes, n_embd=n_embd, n_vocab=n_vocab, n_head=n_head,
            n_embd_k_gqa=n_head_kv * head_dim, n_embd_v_gqa=n_head_kv * head_dim, n_ff=n_ff,
            n_ctx_train=n_ctx_train,
        )

    def largest_tensor(self) -> int:
        if self.largest_tensor_bytes:
            return self.largest_tensor_bytes
        return math.ceil(max(self.layer_bytes, default=0) * LARGEST_TENSOR_SHARE)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["layer_bytes"] = list(self.layer_bytes)
        data["expert_bytes"] = list(self.expert_bytes)
        return data


@dataclass(frozen=True)
class Device:
    """A GPU (or other accelerator) as libggml reports it; `host`: its RPC worker ("HOST:PORT"; "": here)."""

    name: str
    free_bytes: int
    total_bytes: int
    host: str = ""


def capped_devices(devices: Sequence[Device], limit_bytes: int) -> tuple[Device, ...]:
    """Return the devices as if each had at most `limit_bytes` of memory (free and total).

    This is how a big card stands in for a consumer one (`--gpu-memory 8GiB` on an 80 GB card):
    the plan then puts on it only what fits the smaller card, and llama.cpp keeps the rest in RAM
    exactly as it would there, op offload for big batches included.
    """
    if limit_bytes <= 0:
        raise ValueError("a GPU memory limit must be positive")
    return tuple(
        Device(f"{d.name} (at most {_gib(limit_bytes)})" if limit_bytes < d.total_bytes else d.name,
               min(d.free_bytes, limit_bytes), min(d.total_bytes, limit_bytes), d.host)
        for d in devices
    )


def cost_steps(plan: OffloadPlan) -> tuple[int, ...]:
    """Return the batch sizes at which the target's t(n) may jump under this placement.

    Each is the first size of a new regime: above CUDA_VECTOR_KERNEL_MAX_BATCH tokens the GPU's
    layers change kernels; from OP_OFFLOAD_MIN_BATCH tokens, RAM-resident layers run on the GPU
    after their weights are copied over (a pass then costs about the copy, whatever the batch).
    Cost curves measure both sides of every step instead of interpolating across it (none in RAM).
    """
    steps = []
    if plan.target_gpu_layers > 0:
        steps.append(CUDA_VECTOR_KERNEL_MAX_BATCH + 1)
    if plan.op_offload and plan.target_cpu_layers > 0:
        steps.append(OP_OFFLOAD_MIN_BATCH)
    return tuple(steps)


def op_offload_step(plan: OffloadPlan, devices: Sequence[Device]) -> int:
    """The size from which passes copy the target's layers left in RAM to a GPU of this machine (0: none)."""
    return OP_OFFLOAD_MIN_BATCH if plan.op_offload and plan.target_cpu_layers and any(not d.host for d in devices) else 0


def target_mapped(plan: OffloadPlan, devices: Sequence[Device]) -> bool | None:
    """False: read the target, not map it, so its layers in RAM sit in a GPU's pinned memory, which
    big passes copy 5x faster (an H100: docs/benchmarks.md); None (mapped) where no GPU here needs them."""
    return False if op_offload_step(plan, devices) and plan.ram_fits else None


def kv_bytes_per_layer(model: ModelSize, n_ctx: int, kv_type: str | None = None) -> int:
    """Return the K and V cache of one layer for n_ctx cells, of the type given (None: f16)."""
    cells = math.ceil(n_ctx / KV_CELL_PADDING) * KV_CELL_PADDING
    return math.ceil(cells * (model.n_embd_k_gqa + model.n_embd_v_gqa) * KV_BYTES_PER_VALUE[kv_type or "f16"])


def compute_buffer_bytes(model: ModelSize, n_ctx: int, n_tokens: int, flash_attn: bool = False) -> int:
    """Return an estimate of one backend's compute buffer for a batch of n_tokens tokens.

    llama.cpp's graph allocator reuses memory, so the buffer is about the largest set of
    activations alive at once, per token in float32: the biggest of the logits (n_vocab), the
    attention scores and their softmax (2 * n_head * n_ctx; absent with flash attention) and the
    FFN's gate and up projections (2 * n_ff), plus a few n_embd-wide vectors (residual stream,
    normed input, attention output, projection).
    """
    n_ff = model.n_ff or FFN_WIDTH_ESTIMATE * model.n_embd
    scores = 0 if flash_attn else 2 * model.n_head * n_ctx
    per_token = max(model.n_vocab, scores, 2 * n_ff) + 4 * model.n_embd
    return n_tokens * per_token * FLOAT32_BYTES


def logits_buffer_bytes(model: ModelSize, n_tokens: int) -> int:
    """Return the host buffer llama.cpp fills with float32 logits for every token of a batch."""
    return n_tokens * model.n_vocab * FLOAT32_BYTES


@dataclass(frozen=True)
class ContextBytes:
    """What one model's contexts in a run take beside its weights, as llama.cpp sizes them (its
    simulation, engine.memory): KV cache and recurrent state, compute buffer, output buffer."""

    context: int  # KV cache and recurrent state, every context of the model (target: MTP's too)
    compute: int
    output: int


@dataclass(frozen=True)
class PlaceBytes:
    """The planned bytes in one place (a GPU, or RAM), by what they hold."""

    name: str
    model: int = 0  # weights
    context: int = 0  # KV cache and recurrent state
    compute: int = 0  # compute buffers (and the weights op offload copies in for big batches)
    output: int = 0  # logits

    @property
    def total(self) -> int:
        return self.model + self.context + self.compute + self.output

    def plus(self, model: int = 0, context: int = 0, compute: int = 0, output: int = 0) -> PlaceBytes:
        return replace(self, model=self.model + model, context=self.context + context,
                       compute=self.compute + compute, output=self.output + output)

    def to_dict(self) -> dict:
        return {"name": self.name, "model": self.model, "context": self.context, "compute": self.compute,
                "output": self.output, "total": self.total}


@dataclass(frozen=True)
class OffloadPlan:
    """Where everything goes, and the memory each place is predicted to need.

    `target_gpu_layers` is llama.cpp's n_gpu_layers (see the module docstring);
    `target_tensor_split` holds the per-device slot counts to pass as tensor_split (empty when
    nothing is offloaded). The draft goes whole onto `draft_device` (an index into the devices;
    load it there alone, with n_gpu_layers = `draft_gpu_layers`) or stays in RAM (None).
    `op_offload` says whether the target context should let the GPU run big-batch matmuls on
    RAM-resident weights: planned only when device 0 (where llama.cpp sends them) has room. A draft
    in RAM should run with op offload off: its passes are narrow, and no GPU room is planned for it.
    """

    target_gpu_layers: int
    target_n_slots: int  # n_layer + 1
    target_tensor_split: tuple[float, ...]
    draft_device: int | None
    draft_gpu_layers: int
    op_offload: bool
    device_bytes: tuple[int, ...]  # predicted use per device
    device_limit_bytes: tuple[int, ...]  # free minus margin
    ram_bytes: int
    ram_limit_bytes: int
    overridden: bool
    warnings: tuple[str, ...]
    breakdown: tuple[PlaceBytes, ...] = ()  # per device, then RAM: device_bytes and ram_bytes by kind
    cpu_expert_layers: int = 0  # the first N layers keep their routed experts in RAM (MoE models)
    measured: bool = False  # the context figures are llama.cpp's own (its simulation), not estimates
    head_in_ram: bool = False  # --head here kept the output layer in RAM, off the RPC worker its slot (the last) went to
    head_why: str = ""  # why it is where it is, where that was measured (hardware.placement.plan)

    @property
    def gpu_fits(self) -> bool:
        return all(used <= limit for used, limit in zip(self.device_bytes, self.device_limit_bytes))

    @property
    def ram_fits(self) -> bool:
        return self.ram_bytes <= self.ram_limit_bytes

    @property
    def fits(self) -> bool:
        return self.gpu_fits and self.ram_fits

    @property
    def target_cpu_layers(self) -> int:
        return self.target_n_slots - self.target_gpu_layers

    def to_dict(self) -> dict:
        data = asdict(self)
        for key in ("target_tensor_split", "device_bytes", "device_limit_bytes", "warnings"):
            data[key] = list(data[key])
        data["breakdown"] = [place.to_dict() for place in self.breakdown]
        return data


@dataclass(frozen=True)
class _Buffers:
    """What one model needs besides its layers, for the context it will run with."""

    kv_layer: int
    compute: int
    weight_copies: int  # op offload copies when the output layer is on the GPU
    weight_copies_no_output: int  # ... and when the output layer stays in RAM too
    logits: int

    @classmethod
    def of(cls, model: ModelSize, n_ctx: int, n_tokens: int, flash_attn: bool,
           measured: ContextBytes | None = None, kv_type: str | None = None) -> _Buffers:
        """The buffers llama.cpp sizes (`measured`: its simulation; the context spread evenly over
        the layers, each placed with its layer), else estimated from the model's shape."""
        copies = OP_OFFLOAD_COPIED_TENSORS * model.largest_tensor()
        if measured is not None:
            return cls(kv_layer=math.ceil(measured.context / max(model.n_layer, 1)), compute=measured.compute,
                       weight_copies=copies, weight_copies_no_output=max(copies, model.output_bytes),
                       logits=measured.output)
        return cls(
            kv_layer=kv_bytes_per_layer(model, n_ctx, kv_type),
            compute=compute_buffer_bytes(model, n_ctx, n_tokens, flash_attn),
            weight_copies=copies,
            weight_copies_no_output=max(copies, model.output_bytes),
            logits=logits_buffer_bytes(model, n_tokens),
        )


def _whole_model_gpu_bytes(model: ModelSize, buffers: _Buffers) -> int:
    return sum(model.layer_bytes) + model.output_bytes + model.n_layer * buffers.kv_layer + buffers.compute


def _slot_costs(model: ModelSize, buffers: _Buffers, gpu_layers: int) -> list[int]:
    """Return the bytes of the last `gpu_layers` slots, in slot order (output layer last)."""
    costs = [b + buffers.kv_layer for b in model.layer_bytes] + [model.output_bytes]
    return costs[len(costs) - gpu_layers:] if gpu_layers else []


def _device0_fixed(model: ModelSize, buffers: _Buffers, gpu_layers: int, op_offload: bool) -> int:
    """Return what device 0 holds for the target regardless of its slots (op offload buffers)."""
    if not op_offload:
        return 0
    slots = model.n_layer + 1
    if gpu_layers == slots:
        return buffers.compute  # nothing left in RAM to copy
    copies = buffers.weight_copies if gpu_layers >= 1 else buffers.weight_copies_no_output
    return buffers.compute + copies


def _fill_devices(slot_costs: Sequence[int], compute: int, used: Sequence[int],
                  limits: Sequence[int], has_compute: Sequence[bool]) -> list[int] | None:
    """Fill devices in order with consecutive slots; return slots per device, or None if they don't fit.

    Filling each device as far as it goes is optimal for ordered, contiguous placement. A device's
    first slot also brings the target's compute buffer unless it already has one.
    """
    counts = [0] * len(limits)
    used = list(used)
    k = 0
    for cost in slot_costs:
        while k < len(limits):
            extra = cost + (0 if counts[k] or has_compute[k] else compute)
            if used[k] + extra <= limits[k]:
                break
            k += 1
        if k == len(limits):
            return None
        used[k] += extra
        counts[k] += 1
    return counts


def _split_like_llama(slots: int, limits: Sequence[int]) -> list[int]:
    """Return the slots per device that llama.cpp's default split (by free memory) would give."""
    counts = [0] * len(limits)
    total = sum(limits)
    if total <= 0:
        counts[0] = slots
        return counts
    cumulative = [sum(limits[: k + 1]) / total for k in range(len(limits))]
    for i in range(slots):
        k = next((k for k, c in enumerate(cumulative) if c > i / slots), len(limits) - 1)
        counts[k] += 1
    return counts


@dataclass(frozen=True)
class _Placement:
    counts: list[int]  # target slots per device
    used: list[int]  # bytes per device, draft included
    fits: bool


def _place_target(
    target: ModelSize, buffers: _Buffers, gpu_layers: int, op_offload: bool,
    base: Sequence[int], limits: Sequence[int],
) -> _Placement:
    """Place the last `gpu_layers` slots on the devices: filled in order if they fit, else as
    llama.cpp's default split would (reported as not fitting)."""
    fixed = list(base)
    has_compute = [False] * len(limits)
    device0 = _device0_fixed(target, buffers, gpu_layers, op_offload)
    if device0:
        fixed[0] += device0
        has_compute[0] = True
    costs = _slot_costs(target, buffers, gpu_layers)
    counts = _fill_devices(costs, buffers.compute, fixed, limits, has_compute)
    fits = counts is not None and all(u <= l for u, l in zip(fixed, limits))
    if counts is None:
        counts = _split_like_llama(gpu_layers, limits)
    used, start = fixed, 0
    for k, count in enumerate(counts):
        used[k] += sum(costs[start:start + count]) + (buffers.compute if count and not has_compute[k] else 0)
        start += count
    return _Placement(counts, used, fits)


def _best_placement(
    target: ModelSize, buffers: _Buffers, base: Sequence[int], limits: Sequence[int],
    op_offload_possible: bool, gpu_layers: int | None,
) -> tuple[int, bool, _Placement]:
    """Return (gpu_layers, op_offload, placement): the most slots that fit, with op offload when
    it fits at all (a big tree pass needs it far more than one more layer on the GPU)."""
    slots = target.n_layer + 1
    candidates = [gpu_layers] if gpu_layers is not None else range(slots, -1, -1)
    for op_offload in (True, False) if op_offload_possible else (False,):
        for candidate in candidates:
            placement = _place_target(target, buffers, candidate, op_offload, base, limits)
            if placement.fits:
                return candidate, op_offload, placement
    # only an override gets here: report how llama.cpp would overflow
    return gpu_layers, False, _place_target(target, buffers, gpu_layers, False, base, limits)


def _experts_in_ram(target: ModelSize, experts: int) -> ModelSize:
    """Return the model as the GPUs see it when its first `experts` layers keep their routed
    experts in RAM (llama.cpp's tensor overrides; its --n-cpu-moe)."""
    layers = tuple(size - (target.expert_bytes[i] if i < experts else 0) for i, size in enumerate(target.layer_bytes))
    return replace(target, layer_bytes=layers)


def _moe_placement(target: ModelSize, buffers: _Buffers, base: Sequence[int],
                   limits: Sequence[int]) -> tuple[int, ModelSize, _Placement] | None:
    """Return (layers whose experts stay in RAM, the model the GPUs hold, placement) for the fewest
    such layers with every other weight on the GPUs, or None where even that does not fit.

    This is how MoE models run on consumer GPUs (llama.cpp's own fit does it too): attention,
    norms and shared weights of every layer on the GPU, which each token needs, and only the
    routed experts, of which a token reads a few, in RAM. Without room for op offload (copying
    a layer's expert stack to the GPU for every big batch would cost more than the CPU's work)."""
    slots = target.n_layer + 1
    low, high = 0, target.n_layer
    if not _place_target(_experts_in_ram(target, high), buffers, slots, False, base, limits).fits:
        return None
    while low < high:  # the fewest layers with experts in RAM that fit (more in RAM only frees room)
        mid = (low + high) // 2
        if _place_target(_experts_in_ram(target, mid), buffers, slots, False, base, limits).fits:
            high = mid
        else:
            low = mid + 1
    view = _experts_in_ram(target, low)
    return low, view, _place_target(view, buffers, slots, False, base, limits)


def plan_offload(
    target: ModelSize,
    draft: ModelSize | None,
    devices: Sequence[Device],
    ram_free_bytes: int,
    n_ctx: int,
    max_tree_tokens: int,
    margin_bytes: int = DEFAULT_MARGIN_BYTES,
    gpu_layers_override: int | None = None,
    flash_attn: bool = False,
    measured: tuple[ContextBytes | None, ContextBytes | None] = (None, None),
    kv_type: str | None = None,
    head_here: bool = False,
) -> OffloadPlan:
    """Return where the target's layers and the draft go, and the memory that needs (`head_here`: see head_in_ram).

    1. The draft goes whole onto the GPU with the most room, if it fits with its KV cache and
       compute buffer: it runs many small passes, which RAM-resident weights would make slow.
    2. Then the most target slots that fit (see the module docstring), filling devices in order,
       with the target's KV cache for n_ctx cells on each layer's device and a compute buffer for
       a batch of `max_tree_tokens` tokens (root included) on every device it uses. When layers
       stay in RAM and trees reach OP_OFFLOAD_MIN_BATCH tokens, device 0 also keeps room for the
       weights llama.cpp copies over for big-batch matmuls, if it can. A mixture-of-experts
       target that does not fit whole keeps instead every layer on the GPUs but the routed
       experts of its first layers, as few as fit (`cpu_expert_layers`, see _moe_placement).
    3. Everything else is in RAM; `ram_fits` is False (with a warning) when it exceeds the free
       RAM minus the margin. Weights are memory-mapped, so that still runs, reading from disk.

    `measured` holds the target's and the draft's context figures as llama.cpp sizes them (its
    simulation with the run's parameters); a model without them is estimated from its shape, the
    target's cache of `kv_type` (--kv-type; the draft's stays f16).
    `gpu_layers_override` (the user's --gpu-layers; negative = all) replaces the search in step 2;
    the plan still reports the predicted memory and warns when a device would overflow. It does
    not move the draft.
    """
    limits = [max(0, d.free_bytes - margin_bytes) for d in devices]
    base = [0] * len(devices)
    places = [PlaceBytes(d.name) for d in devices]
    ram = PlaceBytes("RAM")
    warnings: list[str] = []
    n_tokens = max(1, max_tree_tokens)

    draft_device, draft_gpu_layers = None, 0
    if draft is not None:
        draft_buffers = _Buffers.of(draft, n_ctx, n_tokens, flash_attn, measured[1])
        draft_gpu = _whole_model_gpu_bytes(draft, draft_buffers)
        roomiest = max(_local(devices), key=lambda k: limits[k], default=None)
        draft_context = draft.n_layer * draft_buffers.kv_layer
        if roomiest is not None and draft_gpu <= limits[roomiest]:
            draft_device, draft_gpu_layers = roomiest, draft.n_layer + 1
            base[roomiest] += draft_gpu
            places[roomiest] = places[roomiest].plus(sum(draft.layer_bytes) + draft.output_bytes, draft_context,
                                                     draft_buffers.compute)
            ram = ram.plus(model=draft.input_bytes, output=draft_buffers.logits)
        else:
            ram = ram.plus(draft.file_bytes, draft_context, draft_buffers.compute, draft_buffers.logits)

    buffers = _Buffers.of(target, n_ctx, n_tokens, flash_attn, measured[0], kv_type)
    slots = target.n_layer + 1
    overridden = gpu_layers_override is not None
    cpu_expert_layers, on_gpus = 0, target
    if not devices:
        gpu_layers, op_offload, placement = 0, False, _Placement([], [], True)
        if overridden and gpu_layers_override != 0:
            warnings.append("--gpu-layers has no effect: no GPU was found")
    else:
        wanted = None
        if overridden:
            wanted = slots if gpu_layers_override < 0 else min(gpu_layers_override, slots)
        gpu_layers, op_offload, placement = _best_placement(
            target, buffers, base, limits, n_tokens >= OP_OFFLOAD_MIN_BATCH and not devices[0].host, wanted
        )
        if target.expert_bytes and gpu_layers < slots and not overridden:
            moe = _moe_placement(target, buffers, base, limits)
            if moe is not None:
                cpu_expert_layers, on_gpus, placement = moe
                gpu_layers, op_offload = slots, False
        places = _target_on_devices(on_gpus, buffers, gpu_layers, op_offload, placement.counts, places)

    # in RAM: the input layer, the slots not offloaded, their KV cache, the CPU's compute and the host logits buffers
    cpu_layers = min(slots - gpu_layers, target.n_layer)
    experts_in_ram = sum(target.expert_bytes[:cpu_expert_layers])
    ram = ram.plus(target.input_bytes + sum(target.layer_bytes[:cpu_layers]) + experts_in_ram,
                   cpu_layers * buffers.kv_layer, buffers.compute, buffers.logits)
    head_in_ram = head_here and gpu_layers > 0 and bool([d for d, n in zip(devices, placement.counts) if n][-1].host)
    if gpu_layers == 0 or head_in_ram:
        ram = ram.plus(model=target.output_bytes - target.tied_bytes)

    ram_limit = max(0, ram_free_bytes - margin_bytes)
    for device, used, limit in zip(devices, placement.used, limits):
        if used > limit:
            warnings.append(
                f"{device.name}: the plan needs {_gib(used)} but only {_gib(limit)} is free "
                f"(after a {_gib(margin_bytes)} margin); loading may fail"
            )
    if ram.total > ram_limit:
        warnings.append(
            f"RAM: {_gib(ram.total)} must stay in system memory but only {_gib(ram_limit)} is free "
            f"(after a {_gib(margin_bytes)} margin); weights will be re-read from disk, very slowly"
        )
    return OffloadPlan(
        target_gpu_layers=gpu_layers,
        target_n_slots=slots,
        target_tensor_split=tuple(float(c) for c in placement.counts) if gpu_layers else (),
        draft_device=draft_device,
        draft_gpu_layers=draft_gpu_layers,
        op_offload=op_offload,
        device_bytes=tuple(placement.used),
        device_limit_bytes=tuple(limits),
        ram_bytes=ram.total,
        ram_limit_bytes=ram_limit,
        overridden=overridden,
        warnings=tuple(warnings),
        breakdown=(*places, ram),
        measured=measured[0] is not None,
        cpu_expert_layers=cpu_expert_layers, head_in_ram=head_in_ram,
    )


def _local(devices: Sequence[Device]) -> list[int]:
    """Return the indices of the devices on this machine: the draft runs many small passes, which
    a network round trip each would make slow (and an RPC worker runs no op offload)."""
    return [k for k, d in enumerate(devices) if not d.host]


def _target_on_devices(target: ModelSize, buffers: _Buffers, gpu_layers: int, op_offload: bool,
                       counts: Sequence[int], places: list[PlaceBytes]) -> list[PlaceBytes]:
    """Return the places with the target's offloaded slots added, as _place_target counts them."""
    places = list(places)
    device0 = _device0_fixed(target, buffers, gpu_layers, op_offload)
    if device0:
        places[0] = places[0].plus(compute=device0)
    first = target.n_layer + 1 - gpu_layers  # the first offloaded slot
    for k, count in enumerate(counts):
        slots = range(first, first + count)
        layers = [i for i in slots if i < target.n_layer]
        output = target.output_bytes if target.n_layer in slots else 0
        compute = buffers.compute if count and not (k == 0 and device0) else 0
        places[k] = places[k].plus(sum(target.layer_bytes[i] for i in layers) + output,
                                   len(layers) * buffers.kv_layer, compute)
        first += count
    return places


def _gib(n: int) -> str:
    return f"{n / 1024**3:.1f} GiB"
