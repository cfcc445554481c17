"""Whether a run opens its target's context without flash attention on a CPU, and from what.

llama.cpp's "auto" turns flash attention on wherever its kernels run; on a CPU a tree's passes over
a long context can cost 1.4x-3x as much with it (tuning.attention). A run whose --flash-attn is not
given, whose target attends on this CPU over an f16 cache, one request at a time, opens it off where

- the target's passes pay off without it: as `specrun tune` timed them on the target (its record,
  tuning.attention), or else as estimated at the target's first start (`estimated_costs`): a model
  of the target's attention heads and nothing else (models.synthetic.write_attention_model,
  PROBE_LAYERS layers of its heads over a tiny stream) timed after ATTENTION_CELLS cached tokens
  with it and without, scaled to the target's layers and added to the target's own passes timed
  over a short context (where attention costs little either way). What the kernels cost depends on
  the CPU, the heads and the cache, not on the weights; on the AVX-512 test host the estimate of
  the demo target's 8- and 16-token passes after 1,024 tokens came within 10-15% of what tune timed;
- and the target's passes of several tokens round as near its one-token passes without it as with
  it (`rounds_alike_without`): a Q4_1 target's rows are plain decoding's bit for bit with it on
  this build and move by up to 1.5 in a logit without it, so its greedy answers would part from
  plain decoding's (decoding.pay.rules.attention_off_rounds_alike).

Several requests at once keep llama.cpp's choice: without flash attention a request's rows follow
where its cells sit among the others' (with it they do not), so a seeded sample, or a greedy
near-tie, would move with the load. Both measurements are kept per machine, llama.cpp build, target
file and thread count (records.Records, in the cache folder): only a target's first start pays them.
The estimate is for architectures whose every layer attends over the whole cache with heads of one
size (PROBE_ARCHITECTURES, no sliding window); others keep llama.cpp's default until tuned.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import numpy as np

from specrun import engine, ui
from specrun.decoding.pay.rules import attention_off_rounds_alike
from specrun.engine import Batch
from specrun.errors import EngineError, ModelFileError
from specrun.files import file_key
from specrun.models.synthetic import write_attention_model
from specrun.records import Records
from specrun.tuning.attention import (
    ATTENTION_CELLS, ATTENTION_SIZES, AttentionCosts, applies, measure_attention, stored_costs,
)
from specrun.tuning.measure import measure_curve
from specrun.tuning.profiles import hardware_fingerprint

log = logging.getLogger("specrun")

# Attention as llama's: every layer over the whole cache, heads of one size, rotary positions.
PROBE_ARCHITECTURES = frozenset({
    "llama", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "granite", "granitemoe", "olmo2", "smollm3", "mistral3",
    "glm4", "exaone", "internlm2", "stablelm", "starcoder2",
})
PROBE_LAYERS = 2  # the probe's layers (its passes are scaled to the target's)
PROBE_REPEATS = 3  # the probe model's passes (cheap whatever the target)
BASE_REPEATS = 2  # the target's own passes (a large target's are what its first start waits for)
BASE_PREFIX = 32  # the cached tokens the target's own passes are timed after
# The rounding check: ROUNDING_TOKENS scored one a pass and then in one pass, after as many cached.
ROUNDING_TOKENS = 8
RECORDS = Records("attention", "flash attention record", 64)
PROBE_METHOD = 1  # (a change to a measurement leaves the records of the old one unread)


def choose_flash_attn(opts, target_path: Path | None, target_on_cpu: bool, parallel: int, threads: int) -> tuple[str | None, str]:
    """The target context's flash attention (None: as the options say) and why: off for one request
    at a time where the figures (tune's record, else the estimate) pay off without it and the target
    rounds alike without it; otherwise what the options say (llama.cpp's default where they say nothing)."""
    if target_path is None or parallel > 1 or not applies(opts, target_on_cpu):
        return None, ""
    costs = stored_costs(target_path, threads)
    if costs is None:
        costs = estimated_costs(target_path, threads)
    if costs is None or not costs.off_pays:
        return None, ""
    if not rounds_alike_without(target_path, threads):
        log.info("flash attention kept on: without it this target's passes of several tokens round further from its "
                 "one-token passes (greedy trees would part from plain decoding more often), though they run faster")
        return None, ""
    ratios = costs.ratios()
    tree = max(n for n in ratios if n > 1)
    if costs.estimated:
        return "off", (f"flash attention off: a probe of this CPU's attention estimated this target's {tree}-token passes "
                       f"after {costs.cells:,} cached tokens {ratios[tree]:.1f}x faster without it here (--flash-attn on to keep it)")
    return "off", (f"flash attention off: `specrun tune` timed this target's {tree}-token passes after {costs.cells:,} "
                   f"cached tokens {ratios[tree]:.1f}x faster without it here (--flash-attn on to keep it)")


def probes(target_path: Path) -> bool:
    """Whether a target of this file's architecture can be estimated (PROBE_ARCHITECTURES, no window)."""
    return engine.gguf_architecture(target_path) in PROBE_ARCHITECTURES and not engine.gguf_has_sliding_window(target_path)


def record_key(target_path: Path, threads: int, what: str) -> dict | None:
    """What a measurement of `what` on `target_path` is kept under (None: the file cannot be read)."""
    try:
        target = file_key(target_path)
    except OSError:
        return None
    key = {"what": what, "target": target, "hardware": hardware_fingerprint(), "llama": engine.llama_version_info(),
           "system": engine.system_info(), "threads": threads, "method": PROBE_METHOD}
    if what == "costs":
        key.update(cells=ATTENTION_CELLS, sizes=list(ATTENTION_SIZES), layers=PROBE_LAYERS)
    return key


def estimated_costs(target_path: Path, threads: int) -> AttentionCosts | None:
    """The estimate for this target here: kept from an earlier run, or measured now (and kept; a
    few seconds, said in the log and, on a terminal, by a transient line only: a plan is built
    before a run's own checks, whose error must be the one line a run prints), with the rounding
    check in the same load of the target where it is not kept yet. None where its architecture
    is not estimated or the measurement fails (logged)."""
    if not probes(target_path):
        return None
    record = _read(record_key(target_path, threads, "costs"))
    if record is not None:
        try:
            return AttentionCosts.from_dict(record["attention"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            log.warning("ignoring the flash attention estimate kept for %s (%s): measuring it again", target_path.name, e)
    log.info("timing this CPU's attention at %s's shape, with flash attention and without (once)", target_path.name)
    return _measured(target_path, threads, costs=True, rounds=_kept_rounding(target_path, threads) is None).get("costs")


def rounds_alike_without(target_path: Path, threads: int) -> bool:
    """Whether the target's passes of several tokens round as near its one-token passes without
    flash attention as with it (kept, or measured now on the target and kept). False where it
    cannot be measured."""
    diffs = _kept_rounding(target_path, threads)
    if diffs is None:
        log.info("checking how %s's passes round with flash attention and without (once)", target_path.name)
        diffs = _measured(target_path, threads, costs=False, rounds=True).get("rounding")
    return diffs is not None and attention_off_rounds_alike(diffs["with"], diffs["without"])


def _read(key: dict | None) -> dict | None:
    return RECORDS.read(key) if key else None


def _kept_rounding(target_path: Path, threads: int) -> dict[str, float] | None:
    record = _read(record_key(target_path, threads, "rounding"))
    if record is not None and isinstance(record.get("with"), float) and isinstance(record.get("without"), float):
        return {"with": record["with"], "without": record["without"]}
    return None


def _measured(target_path: Path, threads: int, costs: bool, rounds: bool) -> dict:
    """Load the target once and measure what is asked: {"costs": the estimate (probe), "rounding":
    the check (rounding)}, each kept under its key with the seconds it took; {} where llama.cpp
    cannot load or run the target (its own load will say why) or the probe's file cannot be written."""
    found, seconds = {}, {}
    # On a terminal a transient line says what the first start waits for (a large target's passes
    # take seconds); elsewhere nothing: a run's output and its one-line errors stay as they are.
    try:
        with ui.waiting(f"first start with {target_path.name} on this CPU: timing its attention once"), \
                engine.Model(target_path) as target:
            for what, wanted, measure in (("rounding", rounds, rounding), ("costs", costs, probe)):
                if wanted:
                    began = time.perf_counter()
                    found[what] = measure(target, threads)
                    seconds[what] = round(time.perf_counter() - began, 3)
    except ModelFileError as e:
        log.debug("no flash attention measurement: %s", e)  # (the run's own load says it)
        return {}
    except (EngineError, OSError) as e:
        log.warning("could not time this CPU's attention for %s (%s): keeping llama.cpp's flash attention default",
                    target_path.name, e)
        return {}
    for what, result in found.items():
        key = record_key(target_path, threads, what)
        if key:
            RECORDS.store(key, {**({"attention": result.to_dict()} if what == "costs" else result), "seconds": seconds[what]})
    return found


def rounding(target, threads: int) -> dict[str, float]:
    """The largest logit difference between ROUNDING_TOKENS tokens scored one a pass and in one
    pass (after as many cached) on a loaded target, with flash attention ("with") and without
    ("without")."""
    tokens = [1 + (7 * i + 11) % min(1000, target.n_vocab - 1) for i in range(2 * ROUNDING_TOKENS)]
    prefix, chain = tokens[:ROUNDING_TOKENS], tokens[ROUNDING_TOKENS:]
    diffs = {}
    for name, flash_attn in (("with", "on"), ("without", "off")):
        with engine.Context(target, n_ctx=4 * ROUNDING_TOKENS, n_batch=ROUNDING_TOKENS, threads=threads,
                            flash_attn=flash_attn) as ctx:
            batch = Batch(ROUNDING_TOKENS, 1)
            batch.set_sequence(prefix, 0, 0, "none")
            ctx.decode(batch)
            alone = []
            for i, token in enumerate(chain):
                batch.set_sequence([token], ROUNDING_TOKENS + i, 0, "last")
                ctx.decode(batch)
                alone.append(ctx.logits_row(-1).copy())
            ctx.seq_rm(0, ROUNDING_TOKENS, -1)
            batch.set_sequence(chain, ROUNDING_TOKENS, 0, "all")
            ctx.decode(batch)
            diffs[name] = float(np.max(np.abs(ctx.logits() - np.stack(alone))))
    return diffs


def probe(target, threads: int) -> AttentionCosts:
    """Measure the estimate on a loaded target: its passes over BASE_PREFIX cached tokens (its
    weights' cost), plus its attention after ATTENTION_CELLS tokens with flash attention and
    without, timed on a model of its heads and scaled from PROBE_LAYERS layers to its own
    (EngineError where llama.cpp cannot run either)."""
    n_layer, n_head, n_head_kv = target.n_layer, target.n_head, target.n_head_kv
    head = _meta_int(target, "attention.key_length") or target.n_embd // max(n_head, 1)
    if (_meta_int(target, "attention.value_length") or head) != head:
        raise EngineError("its attention's keys and values are heads of two sizes")
    text = [1 + i % min(1000, target.n_vocab - 1) for i in range(BASE_PREFIX)]
    with engine.Context(target, n_ctx=BASE_PREFIX + max(ATTENTION_SIZES) + 1, n_batch=max(ATTENTION_SIZES),
                        threads=threads, flash_attn="off") as ctx:
        base = measure_curve(ctx, text, ATTENTION_SIZES, repeats=BASE_REPEATS)
    with tempfile.TemporaryDirectory(prefix="specrun-attention-") as folder:
        path = Path(folder) / "attention.gguf"
        try:
            write_attention_model(path, PROBE_LAYERS, n_head, n_head_kv, head)
        except ValueError as e:
            raise EngineError(f"no attention to time: {e}") from e
        with engine.Model(path) as heads:
            attention = measure_attention(heads, threads, repeats=PROBE_REPEATS, beside=0)
    largest = max(base.decode)
    return scaled(base.decode, base.decode[largest] / largest, attention, n_layer / PROBE_LAYERS)


def scaled(base: dict[int, float], prompt_token_s: float, attention: AttentionCosts, layers: float) -> AttentionCosts:
    """The target's estimated costs: its passes' own cost (`base`, seconds by tokens) plus the
    probe's measured passes times `layers` (the target's layers per probe layer), and a prompt's
    likewise (`prompt_token_s` a token of the target's own, from its largest pass timed: a prompt
    of hundreds of tokens reads faster, so the estimated rates are low and their ratio near 1; no
    decision reads them)."""
    cells = attention.cells

    def passes(timed: dict[int, float]) -> dict[int, float]:
        return {n: base[n] + layers * s for n, s in timed.items()}

    def prompt(rate: float) -> float:
        return cells / (cells * prompt_token_s + layers * cells / rate)

    return AttentionCosts(cells, passes(attention.with_s), passes(attention.without_s), prompt(attention.prompt_with),
                          prompt(attention.prompt_without), attention.beside, passes(attention.beside_with_s),
                          passes(attention.beside_without_s), estimated=True)


def _meta_int(model, key: str) -> int | None:
    value = model.meta(f"{model.architecture}.{key}")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
