"""Whether this machine runs the target's passes over a long context faster without flash attention.

llama.cpp turns flash attention on wherever its kernels run ("auto"), on a CPU too, by what its
kernels support, not by what runs faster. Its CPU kernel takes a pass's tokens one at a time and
reads every cached cell again for each, where the matrix products read a cell once for all of a
tree's tokens; how much that costs depends on the CPU: on one 2-core host the demo target's
16-token pass after 1,500 tokens took 110 ms with it and 75 without, on another (AVX-512) 220 ms
and 73 after 1,024, and an agent's tool loop ran 2.1x faster without it (docs/benchmarks.md).
`specrun bench --report` and `specrun tune` measure it here, on the loaded target, and say which to use;
`tune` also keeps what it measured (a record per machine, target file, llama.cpp build and thread
count, beside the tuning profiles), which tuning.flash_attention reads for later runs (one request at
a time, where the target rounds alike without it). The passes are timed beside other requests'
texts too, for the report: flash attention skips their masked cells cheaply, matrix products
compute them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from specrun import engine, files, ui
from specrun.decoding.pay.rules import attention_off_pays
from specrun.tuning import profiles
from specrun.tuning.measure import measure_curve

log = logging.getLogger("specrun")

# Cached tokens the passes are timed after (at most half the run's context), the pass sizes timed
# (one token: plain decoding; a tree's 8 and 16), and how many times each (the median counts).
ATTENTION_CELLS = 1024
ATTENTION_SIZES = (1, 8, 16)
ATTENTION_REPEATS = 3
# ...and again beside this many other requests' texts of as many tokens in the same cache (a
# server's lanes: flash attention skips their masked cells cheaply, matrix products compute them;
# reported, not acted on: beside other requests a text's rows without it follow where its cells sit).
ATTENTION_BESIDE = 3


@dataclass(frozen=True)
class AttentionCosts:
    """The target's passes after `cells` cached tokens, with flash attention and without (seconds
    by tokens in the pass), and the rate each reads a prompt at (tokens/s)."""

    cells: int
    with_s: dict[int, float]
    without_s: dict[int, float]
    prompt_with: float
    prompt_without: float
    # the same passes beside `beside` other requests' texts of `cells` tokens each (0: not timed)
    beside: int = 0
    beside_with_s: dict[int, float] = field(default_factory=dict)
    beside_without_s: dict[int, float] = field(default_factory=dict)
    # estimated from a probe of the target's attention heads (tuning.flash_attention), not timed on it
    estimated: bool = False

    def ratios(self, beside: bool = False) -> dict[int, float]:
        """How many times a pass of n tokens costs with flash attention what it costs without
        (beside other requests' texts: the figures timed so)."""
        with_s, without_s = (self.beside_with_s, self.beside_without_s) if beside else (self.with_s, self.without_s)
        return {n: with_s[n] / without_s[n] for n in with_s}

    @property
    def off_pays(self) -> bool:
        return attention_off_pays(self.ratios())  # (decoding.pay.rules)

    def off_pays_for(self, parallel: int) -> bool:
        """Whether runs of `parallel` requests at once go faster without it: alone by the passes
        alone, beside others by those too, as far as others were timed (more: not known)."""
        if parallel <= 1:
            return self.off_pays
        return parallel <= 1 + self.beside and self.off_pays and attention_off_pays(self.ratios(beside=True))

    def advice(self) -> str:
        ratios = self.ratios()
        sizes = " / ".join(str(n) for n in ratios)
        times = " / ".join(f"{r:.2f}x" for r in ratios.values())
        prompts = self.prompt_with / self.prompt_without - 1.0
        measured = (f"with flash attention the target's passes of {sizes} tokens after {self.cells:,} cached tokens cost {times} "
                    f"what they cost without, and prompts read {abs(prompts):.0%} "
                    f"{'faster' if prompts >= 0 else 'slower'} with it")
        if self.beside:
            beside = " / ".join(f"{r:.2f}x" for r in self.ratios(beside=True).values())
            measured += f"; beside {_others(self.beside)} as long, {beside}"
        if self.off_pays:
            beside = " (beside other requests too)" if self.beside and self.off_pays_for(1 + self.beside) else ""
            return (f"{measured}: `--flash-attn off` suits one agent or long conversation at a time here{beside} "
                    "(after `specrun tune` runs of one request at a time take it unless told, where the target's "
                    "passes round as alike without it)")
        return f"{measured}: keep the default"

    def to_dict(self) -> dict:
        d = {"cells": self.cells, "with_s": _keyed(self.with_s), "without_s": _keyed(self.without_s),
             "prompt_tokens_per_s": {"with": self.prompt_with, "without": self.prompt_without},
             "off_pays": self.off_pays, "advice": self.advice()}
        if self.beside:
            d["beside"] = {"requests": self.beside, "with_s": _keyed(self.beside_with_s),
                           "without_s": _keyed(self.beside_without_s), "off_pays": self.off_pays_for(1 + self.beside)}
        if self.estimated:
            d["estimated"] = True
        return d

    @classmethod
    def from_dict(cls, d: dict) -> AttentionCosts:
        """The figures to_dict wrote (KeyError, TypeError or ValueError where they are not)."""
        prompts, beside = d["prompt_tokens_per_s"], d.get("beside") or {"requests": 0, "with_s": {}, "without_s": {}}
        costs = cls(int(d["cells"]), _timed(d["with_s"]), _timed(d["without_s"]), float(prompts["with"]),
                    float(prompts["without"]), int(beside["requests"]), _timed(beside["with_s"]), _timed(beside["without_s"]),
                    d.get("estimated") is True)
        timed = (*costs.with_s.values(), *costs.without_s.values(), *costs.beside_with_s.values(), *costs.beside_without_s.values())
        if (set(costs.with_s) != set(costs.without_s) or not costs.with_s or not all(s > 0 for s in timed)
                or costs.beside < 0 or (costs.beside and not set(costs.with_s) == set(costs.beside_with_s) == set(costs.beside_without_s))):
            raise ValueError("passes timed with and without flash attention do not match")
        return costs


def _others(n: int) -> str:
    return "1 other request's text" if n == 1 else f"{n} other requests' texts"


def _keyed(seconds: dict[int, float]) -> dict[str, float]:
    return {str(n): s for n, s in seconds.items()}


def _timed(seconds: dict) -> dict[int, float]:
    return {int(n): float(s) for n, s in seconds.items()}


def attention_here(rt, opts) -> AttentionCosts | None:
    """measure_attention on a loaded runtime's target, after half its context (at most
    ATTENTION_CELLS), where its attention runs on this CPU over an f16 cache: None on a GPU or RPC
    workers (their kernels), and over a quantized cache (which needs flash attention). Beside at
    most ATTENTION_BESIDE others, as many as keep the measuring context within the run's own (its
    memory is planned for that many cells, not twice as many)."""
    plan = rt.plan
    if plan.target_gpu_layers or opts.rpc or engine.kv_quantized(plan.target_ctx.kv_type):
        return None
    cells = min(ATTENTION_CELLS, max(64, plan.target_ctx.n_ctx // 2))
    beside = max(0, min(ATTENTION_BESIDE, plan.target_ctx.n_ctx // cells - 1))
    ui.dim(f"timing the target's passes after {cells} tokens with and without flash attention, alone"
           + (f" and beside {_others(beside)}" if beside else ""))
    return measure_attention(rt.target, plan.threads, cells, beside=beside)


def measure_attention(model, threads: int, cells: int = ATTENTION_CELLS, sizes=ATTENTION_SIZES,
                      repeats: int = ATTENTION_REPEATS, beside: int = ATTENTION_BESIDE) -> AttentionCosts:
    """Time the target's passes after `cells` cached tokens in a context of its own with flash
    attention and in one without (an f16 cache, as the default), as tune times its cost curve
    (tuning.measure.measure_curve: every row's logits asked, as a tree's pass does; the median of
    `repeats`), the context's own prefill (the prompt rate), and the same passes with `beside`
    other sequences of `cells` tokens in the cache (a server's other requests)."""
    costs, prompts = {}, {}
    text = [1 + i % min(1000, model.n_vocab - 1) for i in range(cells)]
    for flash_attn in ("on", "off"):
        for others in dict.fromkeys((0, beside)):
            with engine.Context(model, n_ctx=(1 + others) * cells + max(sizes) + 1, n_batch=min(512, cells), threads=threads,
                                flash_attn=flash_attn, n_seq_max=1 + others) as ctx:
                curve = measure_curve(ctx, text, sizes, repeats=repeats, beside=others)
            costs[flash_attn, others] = curve.decode
            prompts.setdefault(flash_attn, cells / curve.context_s)
    return AttentionCosts(cells, costs["on", 0], costs["off", 0], prompts["on"], prompts["off"], beside,
                          costs["on", beside] if beside else {}, costs["off", beside] if beside else {})


# The record `tune` keeps of what it measured, beside the tuning profiles (tuning.profiles: the
# same key, for the target alone, so a change of machine, file, llama.cpp build or threads finds none).
RECORD = "flash attention"


def record_key(target_path: Path, threads: int) -> dict:
    return {**profiles.profile_key(target_path, None, threads=threads), "record": RECORD}


def save_record(target_path: Path, threads: int, costs: AttentionCosts) -> Path:
    """Keep what tune measured on the target (atomically; OSError where it cannot be written)."""
    return profiles.save({"key": record_key(target_path, threads), "attention": costs.to_dict()})


def stored_costs(target_path: Path, threads: int) -> AttentionCosts | None:
    """The figures tune kept for this target here, or None (absent, foreign or unreadable: logged)."""
    try:
        key = record_key(target_path, threads)
    except OSError as e:
        log.debug("cannot identify the target's file for its flash attention record: %s", e)
        return None
    path = profiles.profile_path(key)
    record = files.read_json(path, dict, "flash attention record")
    if record is None or record.get("key") != key:
        return None
    try:
        return AttentionCosts.from_dict(record["attention"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        files.warn_once(path, f"ignoring the flash attention record {path} ({e}): `specrun tune` measures it again")
        return None


def applies(opts, target_on_cpu: bool) -> bool:
    """Whether a run with these options may take its flash attention from the record: --flash-attn
    not given, the target's attention on this CPU (no GPU, no RPC worker) over an f16 cache (a
    quantized one needs flash attention), and a build where the default is not off already."""
    return (opts.flash_attn is None and target_on_cpu and not opts.rpc and not engine.kv_quantized(opts.kv_type)
            and engine.default_flash_attn(opts.kv_type) != "off")
