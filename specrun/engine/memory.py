"""What llama.cpp allocates for a model and its contexts, in llama.cpp's own figures.

llama.cpp can simulate a load: with `no_alloc` and load mode "none" it reads only the GGUF's
metadata and tensor infos, builds the model and its contexts and sizes every buffer (the KV cache
of each kind of layer, the recurrent state with its rollback snapshots, the compute buffers for
the largest batch, the output buffer) without allocating any of them; its own fitting
(common/fit.cpp) works the same way. The sizes are written only to its log, so this module runs
such a simulation with exactly the parameters a run will pass and reads the lines. A real load
writes the same lines (with the weights' buffers too): `Allocation.read` serves both, and the run
compares what it allocated with what was planned.

A simulation needs the file's header and its full size, not its data: a header-only sparse copy
(models.headers) plans a model before it is downloaded.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from specrun.engine.backend import captured_log, llama_version_info
from specrun.engine.context import Context
from specrun.engine.devices import runs_batch_invariant
from specrun.engine.model import Model
from specrun.engine.mtp import MtpContext
from specrun.files import file_key
from specrun.records import Records

MIB = 1024**2

# The lines llama.cpp writes as it sizes its buffers (src/llama-kv-cache.cpp,
# llama-memory-recurrent.cpp, llama-context.cpp, llama-model.cpp). Sizes are MiB with 2 decimals.
_KV = re.compile(r"^llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers")
_STATE = re.compile(r"^llama_memory_recurrent: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers")
_COMPUTE = re.compile(r"(\S+) compute buffer size = +([\d.]+) MiB")
_OUTPUT = re.compile(r"(\S+) +output buffer size = +([\d.]+) MiB")
_MODEL = re.compile(r"(\S+) model buffer size = +([\d.]+) MiB")
_FLASH = re.compile(r"Flash Attention (enabled|not supported)", re.IGNORECASE)


def _bytes(mib: str) -> int:
    return round(float(mib) * MIB)


@dataclass(frozen=True)
class Allocation:
    """The bytes llama.cpp allocated (or, simulated, would allocate) for one context, or the sum
    of several: by what they hold, and per buffer type ("CPU", "CUDA0", ...) where it says."""

    kv: int = 0  # attention keys and values, every cache (full and sliding-window layers)
    kv_layers: int = 0
    state: int = 0  # recurrent state, every copy (sequences x (1 + rollback snapshots))
    state_layers: int = 0
    compute: dict[str, int] = field(default_factory=dict)
    output: int = 0  # the host buffer of logits
    model: dict[str, int] = field(default_factory=dict)  # weights (a real load; a simulation logs none)
    flash_attn: bool | None = None  # as llama.cpp resolved "auto" (None: it did not say)

    @classmethod
    def read(cls, lines: Iterable[str]) -> Allocation:
        """Return the figures llama.cpp's log lines state."""
        kv = kv_layers = state = state_layers = output = 0
        compute: dict[str, int] = {}
        model: dict[str, int] = {}
        flash = None
        for line in lines:
            text = line.strip()
            if m := _KV.match(text):
                kv += _bytes(m.group(1))
                kv_layers += int(m.group(3))
            elif m := _STATE.match(text):
                state += _bytes(m.group(1))
                state_layers += int(m.group(3))
            elif m := _COMPUTE.search(text):
                compute[m.group(1)] = compute.get(m.group(1), 0) + _bytes(m.group(2))
            elif m := _OUTPUT.search(text):
                output += _bytes(m.group(2))
            elif m := _MODEL.search(text):
                model[m.group(1)] = model.get(m.group(1), 0) + _bytes(m.group(2))
            elif m := _FLASH.search(text):
                flash = m.group(1).lower() == "enabled"
        return cls(kv, kv_layers, state, state_layers, compute, output, model, flash)

    @property
    def context(self) -> int:
        """The context's memory: KV cache and recurrent state."""
        return self.kv + self.state

    @property
    def compute_total(self) -> int:
        return sum(self.compute.values())

    @property
    def model_total(self) -> int:
        return sum(self.model.values())

    @property
    def weights(self) -> int:
        """The weights' own buffers (mapped from the file, or on a device), without repacked copies."""
        return self.model_total - self.repacked

    @property
    def repacked(self) -> int:
        """Copies of quantized weights in the CPU's preferred layout ("CPU_REPACK" buffers): the
        CPU backend chooses them per tensor at load; the file's pages for them are read once."""
        return sum(size for name, size in self.model.items() if "REPACK" in name)

    @property
    def total(self) -> int:
        return self.model_total + self.context + self.compute_total + self.output

    def __add__(self, other: Allocation) -> Allocation:
        def merged(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
            return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}

        return Allocation(
            self.kv + other.kv, self.kv_layers + other.kv_layers, self.state + other.state,
            self.state_layers + other.state_layers, merged(self.compute, other.compute),
            self.output + other.output, merged(self.model, other.model),
            self.flash_attn if self.flash_attn is not None else other.flash_attn,
        )

    def to_record(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Allocation:
        return cls(**data)

    def to_dict(self) -> dict:
        return {"model": self.model_total, "kv": self.kv, "state": self.state, "compute": self.compute_total,
                "output": self.output, "total": self.total, "compute_by_buffer": dict(self.compute),
                "flash_attn": self.flash_attn}

    def with_outputs(self, n_outputs: int, n_seq_max: int) -> Allocation:
        """These figures once a pass has asked for `n_outputs` rows of logits: llama.cpp sizes its
        output buffer for n_seq_max rows when it opens a context and grows it, at the first pass
        that asks for more, to that pass's rows (llama_context::output_reserve)."""
        if n_outputs <= n_seq_max or n_seq_max < 1:
            return self
        return replace(self, output=round(self.output * n_outputs / n_seq_max))


@dataclass(frozen=True)
class ContextSpec:
    """The llama.cpp context parameters a run opens (engine.Context's), or an MTP context."""

    n_ctx: int
    n_batch: int
    n_seq_max: int = 1
    n_rs_seq: int = 0
    mtp: bool = False  # an MTP context on the same model (engine.MtpContext)
    swa_full: bool = True  # sliding-window layers keep every cell (engine.Context)
    n_outputs: int = 0  # the most rows of logits one pass asks for (Allocation.with_outputs)
    flash_attn: str | None = None  # engine.Context's flash_attn (None: its default)
    kv_type: str | None = None  # engine.Context's kv_type (None: f16)
    split: bool = False  # a cache per sequence (engine.Context's kv_unified off)


# A hybrid's recurrent state at least this large (simulated without rollback snapshots) is counted
# once per snapshot rather than simulated with them (Simulation._simulate): below it, llama.cpp's
# log figures, in hundredths of a MiB, are too coarse to multiply, and zeroing the copies costs nothing.
SCALED_STATE_BYTES = 16 << 20


# What else the graph holds at the snapshots' peak, of its largest compute buffer without them:
# measured 0.76-0.82 on Qwen3.5 shapes (contexts of 1k to 32k, 2 to 8 chains of 4 to 8, ubatches
# of 256 and 512), so with a margin (tests/test_published_shapes.py).
SNAPSHOT_PEAK_BESIDE = 0.85


# How a record's figures were made: a change to Simulation._simulate's arithmetic leaves records of
# the old one unread (a hybrid's small state scaled per snapshot, kept on disk, outlived its fix).
RECORD_METHOD = 3
# Records kept in the cache (each a few hundred bytes): past this many the least recently used
# go. Every plan's search simulates contexts of several sizes, and every model file (a new
# download, a test's) keys its own: an unbounded folder had grown to 3,500 files on one machine.
MAX_RECORDS = 1024
# (Not in memory/, where the memory of answers is saved: decoding.memory, paths.memory_dir.)
RECORDS = Records("allocations", "memory record", MAX_RECORDS)


class Simulation:
    """llama.cpp's simulated load of one model file (loaded as given), asked for the contexts a
    run may open; each answer is kept on disk per file version, so later runs do not load the
    metadata again (a large vocabulary takes most of a second)."""

    def __init__(self, path: Path, *, n_gpu_layers: int = 0, tensor_split: Sequence[float] = (),
                 load_mtp: bool = False):
        self.path = Path(path)
        self._load = {"n_gpu_layers": n_gpu_layers, "tensor_split": list(tensor_split), "load_mtp": load_mtp}
        self._model: Model | None = None
        self._known: dict[ContextSpec, Allocation] = {}

    def context(self, spec: ContextSpec) -> Allocation:
        """Return what llama.cpp would allocate for this context (raises EngineError where it
        refuses), its output buffer grown to the rows its passes ask for."""
        if spec.n_outputs:
            return self.context(replace(spec, n_outputs=0)).with_outputs(spec.n_outputs, spec.n_seq_max)
        if spec not in self._known:
            key = _record_key(self.path, spec, self._load)
            cached = RECORDS.read(key) if key else None
            if cached is not None:
                allocation = Allocation.from_dict(cached["allocation"])
            else:
                allocation = self._simulate(spec)
                if key:
                    RECORDS.store(key, {"allocation": allocation.to_record()})
            self._known[spec] = allocation
        return self._known[spec]

    def _simulate(self, spec: ContextSpec) -> Allocation:
        if spec.n_rs_seq and not spec.mtp:
            # llama.cpp allocates and zeroes a hybrid's recurrent state for real even in a simulated
            # load (llama-memory-recurrent.cpp has no no_alloc path): Qwen3.5-27B's chains keep 36
            # copies, 5 GB and ten seconds of page faults, for every context the plan's search tries.
            # Each rollback snapshot is one more copy of every sequence's state, so the context is
            # simulated without them and its state counted once per snapshot: the state and the
            # KV cache as llama.cpp allocates them. The graph with snapshots also holds, at its
            # peak, a layer's state of every sequence for each snapshot, beside most of what its
            # other peak holds (SNAPSHOT_PEAK_BESIDE); where that is the larger peak depends on the
            # model (Qwen3.5-0.8B's shape, 4 chains of 8: 19 MB more at 4k, 0 with 2 chains;
            # Qwen3.5-27B at 4k: none, its logits' 544 MB peak is larger; planned 567).
            base = self.context(replace(spec, n_rs_seq=0))  # kept too: plain runs of the model ask for it
            if base.state >= SCALED_STATE_BYTES:
                return _with_snapshots(base, spec.n_seq_max, spec.n_rs_seq)
            # A small state is cheap to zero, and its log line's 0.01 MiB would be multiplied too
            # (a tiny model's 5.7 kB a copy logged as 10.5: its chains' state planned 1.8x over).
        if self._model is None:
            with captured_log(quiet=True):
                self._model = Model(self.path, n_gpu_layers=self._load["n_gpu_layers"],
                                    tensor_split=self._load["tensor_split"], load_mtp=self._load["load_mtp"],
                                    simulate=True)
        with captured_log(quiet=True) as lines:
            ctx = _open(self._model, spec)
        ctx.close()
        return Allocation.read(lines)

    def close(self) -> None:
        if self._model is not None:
            self._model.close()
            self._model = None

    def __enter__(self) -> Simulation:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _with_snapshots(base: Allocation, n_seq: int, n_rs_seq: int) -> Allocation:
    """A hybrid context's figures with n_rs_seq rollback snapshots per sequence, from its figures
    without (Simulation._simulate): the state once per copy, the compute buffer's snapshot term."""
    # (llama.cpp's log counts every layer of the model; the attention ones hold no state)
    recurrent = base.state_layers - base.kv_layers if base.state_layers > base.kv_layers else base.state_layers
    layer_state = base.state / max(1, n_seq * recurrent)
    compute = dict(base.compute) or {"CPU": 0}
    largest = max(compute, key=compute.__getitem__)
    peak = SNAPSHOT_PEAK_BESIDE * compute[largest] + n_seq * n_rs_seq * layer_state
    compute[largest] = max(compute[largest], round(peak))
    return replace(base, state=base.state * (1 + n_rs_seq), compute=compute)


def simulate(path: Path, contexts: Sequence[ContextSpec], **load) -> list[Allocation]:
    """Return what llama.cpp would allocate for each of these contexts on the model at `path`,
    loaded as `load` says (Simulation's arguments)."""
    with Simulation(path, **load) as simulation:
        return [simulation.context(spec) for spec in contexts]


def _open(model: Model, spec: ContextSpec) -> Context:
    if spec.mtp:
        return MtpContext(model, spec.n_ctx, n_batch=spec.n_batch, threads=1, n_seq_max=spec.n_seq_max)
    return Context(model, n_ctx=spec.n_ctx, n_batch=spec.n_batch, n_seq_max=spec.n_seq_max, threads=1,
                   n_rs_seq=spec.n_rs_seq, swa_full=spec.swa_full, flash_attn=spec.flash_attn,
                   kv_type=spec.kv_type, kv_unified=not spec.split)


def _record_key(path: Path, spec: ContextSpec, load: dict) -> dict | None:
    """What a simulation's figures are kept under (None: the file cannot be read). A build that
    runs batch invariant allocates for flash attention off and unrepacked weights."""
    try:
        file = file_key(path)
    except OSError:
        return None
    return {"file": file, "context": asdict(spec), "load": load, "llama": llama_version_info(),
            "batch_invariant": runs_batch_invariant(), "method": RECORD_METHOD}
