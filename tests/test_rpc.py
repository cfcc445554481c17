"""The target over llama.cpp's RPC backend: real `specrun worker` processes on 127.0.0.1.

Every run that connects to a worker is a process of its own (`python -m specrun ...`): a process
that connected keeps the workers' devices, and ggml's abort hook, for the rest of its life. What
fails before any connection (bad options, a worker not there) runs in this process.

Needs llama-cpp-python built with the RPC backend (the README's install line); without it these
tests fail saying so.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from conftest import MODEL_CACHE, specrun_argv
from test_offload import LLAMA31_70B_Q4KM, QWEN25_05B_Q4KM
from test_server import ServerProcess
from tiny_archs import tiny_arch_model

from specrun.engine import DeviceInfo, rpc
from specrun.errors import SpecrunError
from specrun.hardware import placement
from specrun.hardware.offload import plan_offload

REPO = Path(__file__).resolve().parents[1]
WORKER_START_S = 120.0
RUN_TIMEOUT_S = 600
PROMPT = "Write two sentences about the sea."
# A raw prompt the demo target continues for a long time (counting), for answers cut mid-way.
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"
# A raw prompt whose continuation copies (lookup's trees pay at once, priced by real pass times).
REPEATING = "red green blue yellow purple orange black white pink brown grey gold silver; " * 6


@pytest.fixture(scope="module", autouse=True)
def rpc_build():
    try:
        rpc.check_rpc_build()
    except SpecrunError as e:
        pytest.fail(f"these tests need llama-cpp-python with the RPC backend: {e}", pytrace=False)


def _env(home: Path) -> dict:
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
               SPECRUN_HOME=str(MODEL_CACHE), SPECRUN_CONFIG=str(home / "config"),
               SPECRUN_PROFILES=str(home / "profiles"), HF_HOME=str(home / "hf"), NO_COLOR="1")
    env.pop("SPECRUN_RPC", None)
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Worker:
    """`specrun worker` on a port of 127.0.0.1, in a subprocess."""

    def __init__(self, home: Path, port: int | None = None, *args: str, env: dict | None = None):
        self.home, self.port, self.args, self.env = home, port or _free_port(), args, env or {}
        self.endpoint = f"127.0.0.1:{self.port}"
        self.start()

    def start(self) -> None:
        argv = specrun_argv("worker", "--port", str(self.port), "--threads", "1", *self.args)
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**_env(self.home), **self.env})
        self.stderr_lines: list[str] = []
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stderr:
                self.stderr_lines.append(line)
                if "specrun worker: serving" in line:
                    ready.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        if not ready.wait(WORKER_START_S):
            self.proc.kill()
            pytest.fail(f"the worker did not start:\n{''.join(self.stderr_lines)}", pytrace=False)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> tuple[int, str]:
        """Ctrl-C it; return (exit status, what it wrote on stdout)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        # wait(), not communicate(), which would read stderr beside the reader thread and keep
        # the worker's last lines from stderr_lines
        self.proc.wait(timeout=60)
        stdout = self.proc.stdout.read()
        self._reader.join(30)
        return self.proc.returncode, stdout


@pytest.fixture(scope="module")
def worker(offline_models, tmp_path_factory):
    w = Worker(tmp_path_factory.mktemp("worker-home"))
    yield w
    rc, stdout = w.stop()
    assert rc == 0, "".join(w.stderr_lines)
    assert stdout == "", "the worker wrote to stdout"


def _specrun(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specrun", *args], capture_output=True, text=True,
                          env=_env(home), timeout=RUN_TIMEOUT_S, check=False)


def _generate_json(home: Path, *args: str) -> tuple[dict, str]:
    """Return (specrun generate --json's result, its stderr)."""
    done = _specrun(home, "generate", "--json", "--ctx-size", "1024", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


# ---------------------------------------------------------------------------------------------
# Errors before anything connects


def test_rpc_endpoints_are_checked_before_anything_loads(cli):
    result = cli("generate", "--rpc", "127.0.0.1", "hello")
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: --rpc '127.0.0.1': expected HOST:PORT (e.g. 192.168.1.20:50052); several are separated by commas"]


def test_a_worker_that_is_not_there_is_one_line_naming_it(cli):
    port = _free_port()
    result = cli("generate", "--rpc", f"127.0.0.1:{port}", "--max-tokens", "4", "hello")
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"error: cannot reach the RPC worker at 127.0.0.1:{port}: connection refused (is `specrun worker` running there?)"]


def test_a_build_without_rpc_names_the_install_line(cli, monkeypatch):
    class NoRpc:
        def __getattr__(self, name):
            return lambda *args: None  # no "RPC" backend in the registry

    monkeypatch.setattr(rpc, "ggml_lib", lambda: NoRpc())
    for args in (["worker", "--port", str(_free_port())], ["plan", "--rpc", f"127.0.0.1:{_free_port()}"]):
        result = cli(*args)
        assert result.exit_code == 1, result.output
        assert result.output.strip().splitlines() == [
            f"error: this llama-cpp-python was built without the RPC backend: reinstall it with {rpc.RPC_INSTALL}"]


def test_a_worker_needs_an_ipv4_address_and_a_free_port(cli):
    result = cli("worker", "--host", "localhost")
    assert result.exit_code == 2
    assert "the worker listens on an IPv4 address" in result.output
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = cli("worker", "--port", str(port))
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [f"error: cannot listen on 127.0.0.1:{port}: Address already in use"]


# ---------------------------------------------------------------------------------------------
# Where the layers go


def test_a_70b_target_spans_two_workers_and_the_draft_stays_on_this_machine():
    gib = 2**30
    devices = [DeviceInfo("CUDA0", "RTX 4060", "gpu", "CUDA", 7 * gib, 8 * gib),  # this machine's, listed first
               DeviceInfo("CPU", "this CPU", "cpu", "CPU", 20 * gib, 32 * gib),
               DeviceInfo("RPC0", "192.168.1.20:50052", "gpu", "RPC", 30 * gib, 32 * gib, host="192.168.1.20:50052"),
               DeviceInfo("RPC1", "192.168.1.21:50052", "gpu", "RPC", 30 * gib, 32 * gib, host="192.168.1.21:50052")]
    gpus = placement.gpus_of(devices)
    assert [d.name for d in gpus] == ["RPC0", "RPC1", "CUDA0"]  # as llama.cpp orders a model's devices
    plan = plan_offload(LLAMA31_70B_Q4KM, QWEN25_05B_Q4KM, gpus, 24 * gib, 4096, 65)
    assert plan.draft_device == 2, "the draft runs many small passes: never across the network"
    slots = [int(n) for n in plan.target_tensor_split]
    assert slots[0] > 0 and slots[1] > 0 and sum(slots) == plan.target_gpu_layers
    assert not plan.op_offload  # llama.cpp would send big-batch matmuls to the first device: a worker
    assert plan.gpu_fits
    # --head here: the output layer's slot is the last offloaded one; where that is a worker's, its
    # matrix is held in this machine's RAM too (and where it is this machine's GPU, nothing changes)
    workers_only = [d for d in gpus if d.host]
    there = plan_offload(LLAMA31_70B_Q4KM, QWEN25_05B_Q4KM, workers_only, 24 * gib, 4096, 65)
    here = plan_offload(LLAMA31_70B_Q4KM, QWEN25_05B_Q4KM, workers_only, 24 * gib, 4096, 65, head_here=True)
    head = LLAMA31_70B_Q4KM.output_bytes - LLAMA31_70B_Q4KM.tied_bytes
    assert head > 0 and here.ram_bytes - there.ram_bytes == head
    assert here.head_in_ram and not there.head_in_ram
    assert here.target_tensor_split == there.target_tensor_split
    last_on_this_gpu = placement.gpus_of([DeviceInfo("CUDA0", "RTX 6000", "gpu", "CUDA", 47 * gib, 48 * gib), devices[1], devices[2]])
    a, b = (plan_offload(LLAMA31_70B_Q4KM, QWEN25_05B_Q4KM, last_on_this_gpu, 24 * gib, 4096, 65, head_here=h) for h in (False, True))
    assert [int(n) for n in a.target_tensor_split][-1] > 0  # the last slots, the output layer's among them, on CUDA0
    assert a.ram_bytes == b.ram_bytes and not b.head_in_ram  # (so the head is not moved off that GPU either)


# ---------------------------------------------------------------------------------------------
# Exact output with the target on a worker


def _model_buffers(stderr: str, kind: str = "model") -> dict[str, float]:
    """{buffer: bytes} from llama.cpp's "... model buffer size = X MiB" lines (or KV; --verbose)."""
    pattern = rf"(\S+) {kind} buffer size = +([\d.]+) MiB"
    return {m.group(1): float(m.group(2)) * 2**20 for m in re.finditer(pattern, stderr)}


def test_a_worker_with_cache_keeps_the_weights_sent_and_a_model_loaded_again_sends_their_hashes(offline_models, tmp_path):
    """`specrun worker --cache` keeps every weight tensor over 10 MB a client sends (here the demo
    target's output matrix, 49,152 x 576 F32, with --head workers), named by its hash; the same
    model loaded again is answered from the folder (the file is not written again), with the
    same text. A folder that cannot be made is one line and a non-zero exit."""
    folder = tmp_path / "kept"
    w = Worker(tmp_path, None, "--cache", env={"SPECRUN_WORKER_CACHE": str(folder)})
    try:
        args = ("--target", "smollm2-135m-f32", "--no-spec", "--max-tokens", "8", "--rpc", w.endpoint,
                "--head", "workers", PROMPT)
        first, _ = _generate_json(tmp_path, *args)
        kept = {entry.name: entry.stat() for entry in folder.iterdir()}
        assert any(stat.st_size == 49152 * 576 * 4 for stat in kept.values()), kept
        assert all(len(name) == 16 and int(name, 16) >= 0 for name in kept), kept
        again, _ = _generate_json(tmp_path, *args)
        assert again["token_ids"] == first["token_ids"]
        assert {entry.name: entry.stat().st_mtime_ns for entry in folder.iterdir()} == \
            {name: stat.st_mtime_ns for name, stat in kept.items()}  # nothing sent again
    finally:
        rc, stdout = w.stop()
    assert rc == 0 and stdout == "", "".join(w.stderr_lines)
    assert any(f"keeping the weights clients send in {folder}" in line for line in w.stderr_lines), w.stderr_lines
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    done = subprocess.run(specrun_argv("worker", "--port", str(_free_port()), "--cache"), capture_output=True, text=True,
                          env={**_env(tmp_path), "SPECRUN_WORKER_CACHE": str(blocked / "kept")}, timeout=RUN_TIMEOUT_S)
    assert done.returncode != 0 and "cannot keep the weights in" in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("how", ["draft trees with lookup", "lookup", "hybrid target"])
def test_greedy_output_over_a_worker_is_local_greedy_output(worker, cli, tmp_path, how):
    hybrid = str(tiny_arch_model(MODEL_CACHE, "qwen35"))
    args = {"draft trees with lookup": ["--target", "smollm2-135m-f32", "--draft", "smollm2-135m-q4",
                                        "--budget", "12", "--depth", "4", PROMPT],
            "lookup": ["--target", "smollm2-135m-q4", "--draft", "lookup", "--raw", REPEATING],
            # its own draft: every chain is accepted, and rolled back over the network where cut
            "hybrid target": ["--target", hybrid, "--draft", hybrid, "--depth", "4", "--raw", PROMPT]}[how]
    local = cli("generate", "--json", "--ctx-size", "1024", "--max-tokens", "40", *args)
    assert local.exit_code == 0, local.output
    remote, stderr = _generate_json(tmp_path, "--max-tokens", "40", "--rpc", worker.endpoint, "--verbose", *args)
    assert remote["token_ids"] == json.loads(local.stdout)["token_ids"]
    assert remote["accepted_per_pass"] > 1.0  # the drafts were verified over the network
    assert any(name.startswith("RPC0[") for name in _model_buffers(stderr)), "no target layer went to the worker"


def test_with_head_here_the_output_layer_stays_here_and_the_answer_is_the_same(worker, cli, tmp_path):
    """--head here: the target's output layer (for the demo target, its tied embedding's copy,
    49,152 x 576 floats) loads on this machine, not the worker, so a pass sends hidden states over
    the network, not a row of logits per tree node; the greedy answer is the one given locally and
    with the head on the worker (the same CPU kernels compute it), and `plan` says where it is."""
    args = ["--target", "smollm2-135m-f32", "--draft", "smollm2-135m-q4", "--budget", "12", "--depth", "4", PROMPT]
    local = cli("generate", "--json", "--ctx-size", "1024", "--max-tokens", "40", *args)
    assert local.exit_code == 0, local.output
    there, there_log = _generate_json(tmp_path, "--max-tokens", "40", "--rpc", worker.endpoint, "--verbose", *args)
    here, here_log = _generate_json(tmp_path, "--max-tokens", "40", "--rpc", worker.endpoint, "--head", "here",
                                    "--verbose", *args)
    assert here["token_ids"] == there["token_ids"] == json.loads(local.stdout)["token_ids"]
    assert here["accepted_per_pass"] > 1.0
    on_worker = {name: size for name, size in _model_buffers(there_log).items() if name.startswith("RPC0[")}
    head_on_worker = {name: size for name, size in _model_buffers(here_log).items() if name.startswith("RPC0[")}
    assert on_worker.keys() == head_on_worker.keys() and len(on_worker) == 1
    moved = sum(on_worker.values()) - sum(head_on_worker.values())
    assert moved >= 49152 * 576 * 4, (on_worker, head_on_worker)  # the whole output matrix, F32
    shown = _specrun(tmp_path, "plan", "--rpc", worker.endpoint, "--head", "here")
    assert shown.returncode == 0, shown.stderr
    assert "output layer here (--head here)" in shown.stdout
    kept = _specrun(tmp_path, "plan", "--rpc", worker.endpoint, "--head", "workers")
    assert "output layer on a worker" in kept.stdout and "output layer here" not in kept.stdout
    as_json = _specrun(tmp_path, "plan", "--json", "--rpc", worker.endpoint, "--head", "here")
    assert json.loads(as_json.stdout)["target"]["head_here"] is True
    code = ("import sys\n"
            "from specrun.engine import rpc\n"
            "from specrun.runtime.options import RunOptions\n"
            "from specrun.runtime.runtime import Runtime\n"
            "from specrun.server.worker import describe\n"
            "rpc.connect([sys.argv[1]])\n"
            "with Runtime(RunOptions(target='smollm2-135m-f32', no_spec=True, ctx_size=512, rpc=(sys.argv[1],),\n"
            "                        head='here', quiet=True)) as rt:\n"
            "    print(describe(rt))\n")
    served = subprocess.run([sys.executable, "-c", code, worker.endpoint], capture_output=True, text=True,
                            env=_env(tmp_path), timeout=RUN_TIMEOUT_S, check=False)
    assert served.returncode == 0, served.stderr
    assert "the output layer on this machine (--head)" in served.stdout  # the server's startup line


def test_by_default_the_output_layer_goes_where_a_pass_measures_faster(worker, tmp_path):
    """No --head: where the output layer's slot goes to a worker, its rows of logits are fetched
    over the link and the layer's product timed here at start, and the faster place is taken.
    Over 100 Mbit/s the demo target's 16 rows of logits (3 MiB) take ~250 ms, the layer a few ms
    on this CPU: here, and the plan gives both figures; --head workers keeps it on the worker."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from bench_rpc import DelayProxy

    proxy = DelayProxy(("127.0.0.1", worker.port), delay_s=0.002, bytes_per_s=12.5e6)
    try:
        endpoint = f"127.0.0.1:{proxy.port}"
        args = ["--target", "smollm2-135m-f32", "--draft", "smollm2-135m-q4", "--rpc", endpoint]
        shown = _specrun(tmp_path, "plan", "--json", *args)
        assert shown.returncode == 0, shown.stderr
        target = json.loads(shown.stdout)["target"]
        assert target["head_here"] is True, target
        measured = re.fullmatch(r"the logits of a 16-token pass take ([\d.]+) ms to come back from (\S+), "
                                r"the output layer ~([\d.]+) ms here", target["head_why"])
        assert measured and measured[2] == endpoint, target["head_why"]
        assert float(measured[1]) > 16 * 49152 * 4 / 12.5e6 * 1e3 * 0.9 > float(measured[3]) > 0
        kept = _specrun(tmp_path, "plan", *args, "--head", "workers")
        assert "output layer on a worker" in kept.stdout and "measured: the logits" not in kept.stdout
        plain = _specrun(tmp_path, "plan", "--json", "--no-spec", *args)
        assert json.loads(plain.stdout)["target"]["head_why"].startswith("the logits of a 1-token pass")
    finally:
        proxy.close()


def test_the_output_layer_is_placed_here_where_its_product_takes_less_than_its_rows_of_logits(monkeypatch):
    """The choice weighs the measured trip of a pass's rows of logits (less the hidden states that
    would cross instead) against the layer's product timed here, for the pass's rows."""
    asked = []

    def fetch_s(worker, sizes):
        asked.append(sizes)
        return {size: 0.001 + size / 1.25e6 for size in sizes}  # 10 Mbit/s

    monkeypatch.setattr(rpc, "fetch_s", fetch_s)
    target = LLAMA31_70B_Q4KM  # (8.2 MB of logits for 16 tokens: 6.5 s at 10 Mbit/s)
    here, why = placement.head_pays_here(target, "10.0.0.2:50052", 16)
    assert asked == [(16 * target.n_embd * 4, 16 * target.n_vocab * 4)]
    logits_ms = 16 * (target.n_vocab - target.n_embd) * 4 / 1.25e6 * 1e3
    assert here is True and f"take {logits_ms:.1f} ms to come back from 10.0.0.2:50052" in why
    monkeypatch.setattr(rpc, "fetch_s", lambda worker, sizes: {size: 0.001 + size / 1.25e11 for size in sizes})
    assert placement.head_pays_here(target, "10.0.0.2:50052", 16)[0] is False  # 1 Tbit/s: nothing to gain here
    one, sixteen = (placement.head_seconds(576, 49152, rows) for rows in (1, 16))
    assert 0 < one < sixteen


def test_head_takes_auto_here_or_workers_and_here_without_a_worker_says_it_does_nothing(cli):
    bad = cli("plan", "--head", "nowhere")
    assert bad.exit_code == 2 and "'nowhere': choose auto, here or workers" in bad.output
    alone = cli("plan", "--head", "here")
    assert alone.exit_code == 0, alone.output
    assert "--head here without --rpc does nothing" in alone.output


# A pass over the worker, timed as the cost curves time it: `decode` returns once the pass is done
# and its logits are back (llama_decode alone returns once the pass is sent), so reading them
# right after costs nothing. Prints the seconds of each, per pass.
_TIMED_PASSES = """
import json, sys, time
import numpy as np
from specrun.engine import Batch, Context, rpc
from specrun.engine.model import Model
rpc.connect([sys.argv[2]])
model = Model(sys.argv[1], n_gpu_layers=99, across_hosts=True)
ctx = Context(model, n_ctx=512, n_batch=64, threads=1)
batch = Batch(64)
out = []
for i in range(4):
    ctx.clear()
    batch.set_arrays(np.arange(64, dtype=np.int32) + 100 * i, np.arange(64, dtype=np.int32), 0, True)
    t0 = time.perf_counter(); ctx.decode(batch); t1 = time.perf_counter()
    ctx.logits().sum(); t2 = time.perf_counter()
    out.append([t1 - t0, t2 - t1])
print(json.dumps(out))
"""


def _run_script(script: str, home: Path, *endpoints: str) -> dict:
    """Run a Python script (its arguments: the workers' endpoints, none to run here) in a process
    of its own; return the JSON it prints."""
    done = subprocess.run([sys.executable, "-c", script, *endpoints], capture_output=True, text=True,
                          env=_env(home), timeout=RUN_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


_TWO_PROMPTS = """
import json, sys
from specrun.core.sampling import SamplingParams
from specrun.decoding.pay.counts import met_counts
from specrun.decoding.stream import token_ids
from specrun.runtime.plan import RunOptions
from specrun.runtime.runtime import Runtime
texts = ["The three most important inventions of the twentieth century are the radio, the " * 3,
         "A short list of rivers in Europe, with a line about each one of them: " * 2]
with Runtime(RunOptions(target="smollm2-135m-f32", draft="lookup", ctx_size=1024, rpc=tuple(sys.argv[1:]), quiet=True)) as rt:
    prompts = [rt.target.tokenize(t, add_special=False) for t in texts]
    tokens = [token_ids(rt.decoder, p, SamplingParams(temperature=0.0), 12) for p in prompts]
    print(json.dumps({"tokens": tokens, "lengths": [len(p) for p in prompts], "network_s": rt.target_ctx.network_s,
                      "counts": sorted(met_counts(rt.target).counts)}))
"""


def test_a_prompt_over_a_worker_is_filled_to_a_count_met_before_and_answers_the_same(worker, tmp_path):
    """Over RPC workers each new count of tokens costs round trips once a process (ggml-rpc asks
    the worker its shapes' sizes), and a prompt's length is new nearly every request: the first
    prompt's pass is filled to a count a tree's pass meets (NETWORK_PASSES), the second's to
    that count, met before (decoding.pay.counts); both answers are the ones decoded here
    without a worker."""
    from specrun.core.tree_shapes import NETWORK_PASSES

    here, there = (_run_script(_TWO_PROMPTS, tmp_path, *endpoints) for endpoints in ((), (worker.endpoint,)))
    assert there["tokens"] == here["tokens"]
    first, second = there["lengths"]
    assert second < first <= 2 * second and first < 64, there["lengths"]  # (the rule's reach, under TILE_ROWS)
    assert there["network_s"] > 0 and here["network_s"] == 0
    shared = min(n for n in NETWORK_PASSES if n >= first)
    assert shared in there["counts"] and first not in there["counts"] and second not in there["counts"], there


_TWO_AT_ONCE = """
import json, sys, threading
from specrun.core.sampling import SamplingParams
from specrun.decoding.pay.counts import met_counts
from specrun.decoding.stream import token_ids
from specrun.runtime.plan import RunOptions
from specrun.runtime.runtime import Runtime
texts = ["The three most important inventions of the twentieth century are the radio, the ",
         "A short list of rivers in Europe, with a line about each one of them: the Danube, "]
with Runtime(RunOptions(target="smollm2-135m-f32", draft="smollm2-135m-q4", ctx_size=512, parallel=2,
                        rpc=tuple(sys.argv[1:]), quiet=True)) as rt:
    decoders = rt.decoders
    prompts = [rt.target.tokenize(t, add_special=False) for t in texts]
    out = [None, None]
    def run(i):
        decoders[i].lane.join()
        try:
            out[i] = token_ids(decoders[i], prompts[i], SamplingParams(temperature=0.0), 24)
        finally:
            decoders[i].lane.leave()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    [t.start() for t in threads]; [t.join() for t in threads]
    print(json.dumps({"tokens": out, "network": [[d.network_sizes, d.network_s > 0, d.overlap] for d in decoders],
                      "shared": rt.decoders[0].lane.gate.shared_passes,
                      "prepared": [d.drafter.draft.grower.prepared for d in decoders]}))
"""


def test_requests_at_once_over_a_worker_answer_as_here_and_keep_to_the_network_s_counts(worker, tmp_path):
    """Two requests decoding together (--parallel 2) with the target on a worker: their decoders
    know the network as a request alone does (trees kept to counts met, each count's first pass
    apart, the draft reading a prompt while the target's pass over it runs), their shared passes
    are filled (batching.PassGate._fill), and each answer is the one decoded here."""
    here, there = (_run_script(_TWO_AT_ONCE, tmp_path, *endpoints) for endpoints in ((), (worker.endpoint,)))
    assert there["tokens"] == here["tokens"] and all(len(t) == 24 for t in here["tokens"])
    assert here["network"] == [[False, False, False]] * 2 and there["network"] == [[True, True, True]] * 2
    assert there["shared"] > 0 and sum(there["prepared"]) > 0 and sum(here["prepared"]) == 0


def test_a_pass_over_a_worker_is_timed_whole(worker, offline_models, tmp_path):
    """The pass time that sizes trees covers the worker's compute and the logits' trip back: what
    is read after `decode` is already here (64 rows of logits: 12 MiB over the network)."""
    result = subprocess.run([sys.executable, "-c", _TIMED_PASSES, str(offline_models.smollm2_f32), worker.endpoint],
                            capture_output=True, text=True, env=_env(tmp_path), timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-2000:]
    passes = json.loads(result.stdout)
    for decode_s, read_s in passes[1:]:  # (the first pass allocates)
        assert read_s < 0.2 * decode_s, passes


# ---------------------------------------------------------------------------------------------
# A worker lost mid-answer


def _served(home: Path, endpoint: str, *args: str) -> ServerProcess:
    """`specrun serve` of the Q4_1 demo model drafting by lookup, its target on the worker at `endpoint`."""
    return ServerProcess(home, "--target", "smollm2-135m-q4", "--draft", "lookup", "--rpc", endpoint, *args)


def _counting(max_tokens: int) -> dict:
    """A greedy completion that counts on (no end-of-text) for max_tokens tokens."""
    return {"model": "x", "prompt": COUNTING, "max_tokens": max_tokens, "temperature": 0,
            "logit_bias": {str(t): -100 for t in (0, 1, 2)}}


def test_a_worker_killed_mid_answer_ends_that_answer_and_the_server_stays_up(offline_models, tmp_path):
    w = Worker(tmp_path)
    server = _served(tmp_path, w.endpoint)
    try:
        url = server.wait_ready()
        body = {**_counting(900), "stream": True}
        events, error = [], None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                    break
                events.append(event["choices"][0]["text"])
                if len(events) == 5:
                    w.kill()
        assert error is not None, "the answer ran to its end although its worker was killed"
        assert w.endpoint in error["message"] and error["code"] == "rpc_worker_lost"
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"

        w.start()  # the worker is back on its port: the next request reconnects
        again = httpx.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 30}, timeout=300)
        assert again.status_code == 200, again.text
        text = again.json()["choices"][0]["text"]
        cut = "".join(events)
        assert text.startswith(cut[:len(text)]) or cut.startswith(text), (cut, text)  # the same greedy answer
        assert "lost the RPC worker at " + w.endpoint in server.stderr
    finally:
        rc = server.terminate()
        w.kill()
    assert rc == 0, server.stderr


def _stream(url: str, body: dict, pieces: list[str], started: threading.Event | None = None,
            kill_after: tuple[int, Worker] | None = None) -> dict | None:
    """Stream a completion into `pieces` (setting `started` at its first piece; killing a worker
    after so many pieces); return the error event that ended it, if one did."""
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return event["error"]
            pieces.append(event["choices"][0]["text"])
            if started is not None:
                started.set()
            if kill_after is not None and len(pieces) == kill_after[0]:
                kill_after[1].kill()
    return None


def test_clients_at_once_over_a_worker_are_answered_together_and_as_alone(worker, tmp_path):
    """`serve --rpc` relays as many requests at once as its lanes (--parallel) to the process that
    holds the target: a short request sent while a long answer streams is answered before that
    answer ends, and both answers are the ones each prompt gets alone (greedy; the Q4_1 target
    rounds a row alike in a pass shared or not, docs/exactness.md)."""
    server = _served(tmp_path, worker.endpoint, "--parallel", "2")
    try:
        url = server.wait_ready()
        long = _counting(160)
        short = {"model": "x", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
        long_pieces, short_pieces, started = [], [], threading.Event()
        streaming = threading.Thread(target=_stream, args=(url, long, long_pieces, started))
        streaming.start()
        assert started.wait(120), server.stderr
        assert _stream(url, short, short_pieces) is None
        long_seen = len(long_pieces)
        streaming.join(300)
        assert not streaming.is_alive()
        assert long_seen < len(long_pieces), "the short answer waited for the long one to end"
        for body, pieces in ((short, short_pieces), (long, long_pieces)):
            alone = httpx.post(url + "/v1/completions", json=body, timeout=300)
            assert alone.status_code == 200, alone.text
            assert alone.json()["choices"][0]["text"] == "".join(pieces)
        # The memory of answers lives with the target, in the child process: /v1/models asks it.
        memory = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["meta"]["answers_memory"]
        assert memory is not None and memory["answers"] >= 2 and memory["tokens"] > 160 and memory["bytes"] > 0
    finally:
        rc = server.terminate()
    assert rc == 0, server.stderr
    assert "one request at a time" not in server.stderr


def test_over_a_worker_a_prompt_that_cannot_fit_is_refused_as_it_arrives(worker, tmp_path):
    """The process that holds the target reads a request's prompt as it arrives (the parent has
    no tokenizer): one over the context gets its 400 while the one lane is busy with another
    answer, not once its turn comes; a prompt that fits is answered at its turn as ever."""
    server = _served(tmp_path, worker.endpoint, "--parallel", "1")
    try:
        url = server.wait_ready()
        long = _counting(400)
        pieces, started = [], threading.Event()
        streaming = threading.Thread(target=_stream, args=(url, long, pieces, started))
        streaming.start()
        assert started.wait(120), server.stderr
        over = httpx.post(url + "/v1/completions", json={"model": "x", "prompt": "sea " * 2000, "max_tokens": 8},
                          timeout=300)
        busy = streaming.is_alive()
        assert over.status_code == 400, over.text
        assert over.json()["error"]["code"] == "context_length_exceeded", over.text
        assert busy, "the refusal waited for the answer before it"
        fits = httpx.post(url + "/v1/completions", json={"model": "x", "prompt": PROMPT, "max_tokens": 8,
                                                         "temperature": 0}, timeout=300)
        assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] > 0, fits.text
        streaming.join(300)
    finally:
        rc = server.terminate()
    assert rc == 0, server.stderr


def test_a_worker_killed_under_two_answers_ends_both_and_the_server_stays_up(offline_models, tmp_path):
    """Two answers in flight through one child process when the worker goes: each ends with the
    error naming it (the relay tells every answer of a lost child, not only the first)."""
    w = Worker(tmp_path)
    server = _served(tmp_path, w.endpoint, "--parallel", "2")
    try:
        url = server.wait_ready()
        body = _counting(900)
        first, errors, started = [], {}, threading.Event()

        def first_answer() -> None:
            errors["first"] = _stream(url, body, first, started)

        thread = threading.Thread(target=first_answer)
        thread.start()
        assert started.wait(120), server.stderr
        errors["second"] = _stream(url, {**body, "prompt": PROMPT}, [], kill_after=(3, w))
        thread.join(120)
        assert not thread.is_alive()
        for name in ("first", "second"):
            error = errors[name]
            assert error is not None, f"the {name} answer ran to its end although its worker was killed"
            assert w.endpoint in error["message"] and error["code"] == "rpc_worker_lost", error
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
    finally:
        rc = server.terminate()
        w.kill()
    assert rc == 0, server.stderr


# ---------------------------------------------------------------------------------------------
# The plan over two workers


def test_the_plan_over_two_workers_is_what_they_are_given(offline_models, tmp_path):
    first, second = Worker(tmp_path), Worker(tmp_path)
    try:
        args = ["--target", "smollm2-135m-f32", "--no-spec", "--ctx-size", "1024",
                "--rpc", f"{first.endpoint},{second.endpoint}", "--gpu-memory", "800MiB"]
        planned = _specrun(tmp_path, "plan", "--json", *args)
        assert planned.returncode == 0, planned.stderr
        plan = json.loads(planned.stdout)
        places = {place["name"]: place for place in plan["memory"]["breakdown"]}
        hosts = {d["name"]: d["host"] for d in plan["memory"]["devices"]}
        assert sorted(hosts.values()) == sorted([first.endpoint, second.endpoint])
        assert all(places[name]["model"] > 0 for name in hosts), "both workers hold layers"
        text = _specrun(tmp_path, "plan", *args)
        for endpoint in (first.endpoint, second.endpoint):
            assert endpoint in text.stdout

        loaded = _specrun(tmp_path, "generate", "--verbose", "--max-tokens", "2", *args, "hello")
        assert loaded.returncode == 0, loaded.stderr
        for planned, kind in (("model", "model"), ("context", "KV")):
            given = _model_buffers(loaded.stderr, kind)
            for name, host in hosts.items():
                size = next(size for buffer, size in given.items() if buffer.endswith(f"[{host}]"))
                assert places[name][planned] == pytest.approx(size, rel=0.03), (name, kind, given)
    finally:
        first.kill()
        second.kill()


def test_a_worker_that_says_it_has_a_small_card_is_given_no_more_than_it(offline_models, tmp_path):
    """A worker's device is planned by the free memory it reports. scripts/fit_compare.py shows
    llama.cpp's own fit an emulated card so (a proxy that answers the device-memory question with
    the card's size, every other message passed through): the plan puts on such a card no more
    than it holds, the rest of the layers in RAM, and the run loads as planned."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from fit_compare import CardProxy

    card = 900 * 1024**2
    worker = Worker(tmp_path)
    proxy = CardProxy(("127.0.0.1", worker.port), card)
    try:
        args = ["--target", "smollm2-135m-f32", "--no-spec", "--ctx-size", "1024", "--rpc", f"127.0.0.1:{proxy.port}"]
        planned = _specrun(tmp_path, "plan", "--json", *args)
        assert planned.returncode == 0, planned.stderr
        plan = json.loads(planned.stdout)
        (device,) = plan["memory"]["devices"]
        place = next(p for p in plan["memory"]["breakdown"] if p["name"] == device["name"])
        assert 0 < place["model"] and place["total"] <= card, (place, device)
        assert 0 < plan["target"]["gpu_layers"] < plan["target"]["layer_slots"]
        loaded = _specrun(tmp_path, "generate", "--verbose", "--max-tokens", "2", *args, "hello")
        assert loaded.returncode == 0, loaded.stderr
        given = _model_buffers(loaded.stderr, "model")
        size = next(size for buffer, size in given.items() if buffer.endswith(f"[127.0.0.1:{proxy.port}]"))
        assert place["model"] == pytest.approx(size, rel=0.03), given
    finally:
        proxy.close()
        worker.kill()


# ---------------------------------------------------------------------------------------------
# Behind a network: the regime where a pass costs about the same for 1 token or many


def test_behind_a_network_delay_the_untuned_tree_grows_and_the_text_stays_the_targets(worker, cli, tmp_path):
    """With no profile, over a worker 50 ms away, the draft model's chain looks at the size
    above (decoding.drafters.growing: grown and verified whole, its pass timed; drafting during
    the target's pass, the chain of 8 comes before trees), and the answer is still the target's
    greedy answer. (Whether the tree then stays grown depends on
    this host's timings: tests/test_growing.py proves the sizing on set curves.)"""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from bench_rpc import DelayProxy

    proxy = DelayProxy(("127.0.0.1", worker.port), delay_s=0.05, bytes_per_s=125e6)
    args = ["--target", "smollm2-135m-f32", "--draft", "smollm2-135m-q4", "--no-lookup", "--max-tokens", "96", PROMPT]
    local = cli("generate", "--json", "--ctx-size", "1024", *args)
    assert local.exit_code == 0, local.output
    remote, stderr = _generate_json(tmp_path, "--rpc", f"127.0.0.1:{proxy.port}", "--verbose", *args)
    assert remote["token_ids"] == json.loads(local.stdout)["token_ids"]
    assert remote["stats"]["max_tree_nodes"] >= 8, remote["stats"]
    # The draft model grew its tree on while the target's passes were on the network.
    assert remote["stats"]["reused_nodes"] > 0, remote["stats"]


def test_tune_weighs_large_deep_trees_where_the_target_is_on_a_worker(worker, tmp_path):
    """Where the target's passes run on a worker (the draft drafting meanwhile), `tune` calibrates
    trees up to FIXED_COST_SHAPE's size and depth; on this machine's CPU, its settings as given."""
    code = (
        "import json, sys\n"
        "from specrun.commands.tune import FIXED_COST_SHAPE, QUICK, _for_the_passes\n"
        "from specrun.runtime.options import RunOptions\n"
        "pair = dict(target='smollm2-135m-f32', draft='smollm2-135m-q4', ctx_size=1024)\n"
        "out = {}\n"
        "for name, rpc in (('local', ()), ('worker', tuple(sys.argv[1:]))):\n"
        "    s = _for_the_passes(RunOptions(**pair, rpc=rpc), QUICK)\n"
        "    out[name] = [s.max_budget, s.depth]\n"
        "out['quick'] = [QUICK.max_budget, QUICK.depth]\n"
        "out['fixed'] = [FIXED_COST_SHAPE.budget, FIXED_COST_SHAPE.depth]\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run([sys.executable, "-c", code, worker.endpoint], capture_output=True, text=True,
                          env=_env(tmp_path), timeout=RUN_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr
    settings = json.loads(done.stdout)
    assert settings["local"] == settings["quick"] and settings["worker"] == settings["fixed"], settings
    assert settings["fixed"][0] > settings["quick"][0]


def test_the_decoders_of_a_target_on_workers_keep_each_sizes_first_pass_apart(offline_models):
    """Over RPC workers a new count of tokens costs round trips the first time (the demo target
    50 ms away: 538 ms for its first 4-token pass, 125 ms after, 117 ms for one token). Priced as
    a pass, such a first pass kept `--draft lookup` from proposing for most of an answer. Every
    drafter that prices trees by the target's passes keeps them apart where the target runs on
    workers: lookup alone, and the hybrid around a fixed tree, not only trees grown online."""
    from dataclasses import replace

    import numpy as np

    from specrun.runtime.plan import RunOptions
    from specrun.runtime.runtime import Runtime, make_decoder

    def priced(drafter) -> float:
        for n, seconds in ((1, 0.32), (1, 0.117), (4, 0.538), (4, 0.125)):
            drafter.cost.observe(n, seconds)
        return float(drafter.cost(np.array([4]))[0])

    with Runtime(RunOptions(draft="lookup", ctx_size=1024, quiet=True)) as rt:
        on_workers = make_decoder(rt.plan.tree, rt.target, rt.target_ctx, network_sizes=True).drafter
        here = make_decoder(rt.plan.tree, rt.target, rt.target_ctx).drafter
        assert priced(on_workers) == pytest.approx(0.125, rel=0.05)
        assert priced(here) > 0.25  # (on this machine every pass is a point of the curve)
    with Runtime(RunOptions(ctx_size=1024, quiet=True)) as rt:  # the demo pair's hybrid, its tree fixed
        fixed = replace(rt.plan.tree, grow=None)
        on_workers, here = (make_decoder(fixed, rt.target, rt.target_ctx, rt.draft, rt.draft_ctx, network_sizes=network).drafter
                            for network in (True, False))
        assert type(on_workers).__name__ == "HybridDrafter" and type(on_workers.draft).__name__ == "TreeGrower"
        # (its cost scales the passes timed at load: by the later passes alone, or by all)
        assert priced(on_workers) < 0.5 * priced(here)
