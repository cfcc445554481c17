"""The device kit: build llama-cpp-python for this machine's GPU from a trimmed copy of the pinned
sdist, then measure what specrun does there. Runs without a network; the same steps run on a
CPU-only machine (a CPU build, or --fast: the installed llama-cpp-python and tiny shapes).

Steps (each also runs alone; scripts/device_kit.sh chains them):

  prepare   (a machine with PyPI)  KIT/: the trimmed sdist, the vocab GGUF, wheels of what the
            device lacks; prints their sizes (all must travel in 64 MiB)
  build     (the device)  pip wheel with CUDA for the GPU's architecture (nvidia-smi), in the
            background: returns within --wait seconds; run again until it says "built"
  install   the built wheel and the carried wheels into KIT/site (PYTHONPATH)
  models    a dense-27B-shaped and a 30B-A3B-MoE-shaped Q4_K_M target, a 0.5B-shaped draft and a
            tiny random pair, all with the same real tokenizer (--fast/--tiny: scaled-down shapes)
  variants  F16 and Q8_0 copies of the tiny target and the 0.5B shape (llama.cpp's quantize API),
            for scripts/batch_invariance_probe.py and --exact-draft
  exactness speculative vs plain greedy on the tiny random pair (many near-ties: the strictest
            check; --exact-target/--exact-draft choose another pair): identical outputs, and the
            top-2 logit gap where they part
  plan      `specrun plan` against the memory nvidia-smi sees once the models are loaded
  report    `specrun bench --report --json` per emulated card (--cards 8,12,16,24)
  predict   per report, the best tree's predicted speedup with a real pair's acceptance
            (--acceptance REPORT.json, e.g. the demo pair's report measured on a CPU)

Results go to --out as JSON (and the reports as Markdown).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SDIST_NAME = "llama_cpp_python-0.3.36"
VOCAB = "ggml-vocab-qwen2.gguf"
# Under vendor/llama.cpp: what the library build never reads (tools, examples and tests are off
# when llama.cpp is built inside llama-cpp-python; only the CPU and CUDA backends are enabled).
TRIM_LLAMA = ("docs", "tools", "examples", "tests", "benches", "pocs", "app", "media", "ci", "scripts", "skills",
              "conversion", "gguf-py", "grammars", "requirements", "licenses", ".devops", ".github", "AUTHORS",
              "convert_hf_to_gguf.py", "convert_hf_to_gguf_update.py", "convert_llama_ggml_to_gguf.py",
              "convert_lora_to_gguf.py")
KEEP_BACKENDS = ("ggml-cpu", "ggml-cuda")
TRIM_SDIST = ("docs", "docker", "examples", "tests", "scripts", ".git", ".github")
# What the device image lacks of specrun's and llama-cpp-python's dependencies (Python 3.12 there).
DEVICE_WHEELS = ("diskcache", "gguf", "fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types",
                 "typing-inspection", "uvicorn", "httptools")
BUILD_LOG = "build.log"
# --mmap: how the plan step loads the target (specrun's RunOptions.mmap; auto: as the plan decides).
MMAP = {"auto": None, "on": True, "off": False}
# The kit's targets (--targets) and draft, by the shapes they take (specrun/models/synthetic/real_shapes.py).
SHAPE_OF = {"dense-27b": "dense-27b", "moe-30b-a3b": "qwen3-30b-a3b", "draft-0.5b": "qwen2.5-0.5b"}


def log(message: str) -> None:
    print(f"[kit] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# prepare (here)


def trim_sdist(sdist: Path, kit: Path) -> Path:
    """Write KIT/llama-cpp-python-trimmed.tar.gz and KIT/VOCAB from the pinned sdist; return the tarball."""
    work = kit / "sdist-work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(work, filter="data")
    root = work / SDIST_NAME
    llama = root / "vendor" / "llama.cpp"
    shutil.copy2(llama / "models" / VOCAB, kit / VOCAB)
    for name in TRIM_SDIST:
        shutil.rmtree(root / name, ignore_errors=True)
    for name in TRIM_LLAMA + ("models",):
        path = llama / name
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    for backend in (llama / "ggml" / "src").glob("ggml-*"):
        if backend.is_dir() and backend.name not in KEEP_BACKENDS:
            shutil.rmtree(backend)
    out = kit / "llama-cpp-python-trimmed.tar.gz"
    with tarfile.open(out, "w:gz") as tar:
        tar.add(root, arcname=SDIST_NAME)
    shutil.rmtree(work)
    return out


def download_wheels(kit: Path, python_version: str) -> None:
    """pip download the wheels the device lacks (no dependencies: the list is complete)."""
    wheels = kit / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 27, 28)] + ["--platform=manylinux2014_x86_64"]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    f"--python-version={python_version}", "--implementation=cp", *platforms, "-d", str(wheels),
                    *(_pinned(name) for name in DEVICE_WHEELS)], check=True)


def _pinned(name: str) -> str:
    """Return NAME==the version installed here (versions that work together, e.g. pydantic's core)."""
    from importlib import metadata

    try:
        return f"{name}=={metadata.version(name)}"
    except metadata.PackageNotFoundError:
        return name


def prepare(args) -> dict:
    kit = Path(args.kit)
    kit.mkdir(parents=True, exist_ok=True)
    sdist = Path(args.sdist)
    if not sdist.is_file():
        raise SystemExit(f"no sdist at {sdist}: pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36")
    tarball = trim_sdist(sdist, kit)
    if not args.no_wheels:
        download_wheels(kit, args.python_version)
    sizes = {p.name: p.stat().st_size for p in [tarball, kit / VOCAB] + sorted((kit / "wheels").glob("*.whl"))}
    total = sum(sizes.values())
    log(f"trimmed sdist {tarball.stat().st_size / 2**20:.1f} MiB (the full one: {sdist.stat().st_size / 2**20:.1f} MiB); "
        f"kit {total / 2**20:.1f} MiB in all")
    return {"sdist_bytes": sdist.stat().st_size, "trimmed_bytes": tarball.stat().st_size, "kit_bytes": total,
            "files": sizes}


# ---------------------------------------------------------------------------------------------
# build and install (the device)


def gpu_arch() -> str | None:
    """Return the GPU's CUDA architecture ("90" for an H100) from nvidia-smi, or None without one."""
    if not shutil.which("nvidia-smi"):
        return None
    done = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True, text=True)
    cap = done.stdout.strip().splitlines()[0].strip() if done.returncode == 0 and done.stdout.strip() else ""
    return cap.replace(".", "") or None


def build(args) -> dict:
    """Start (or keep polling) the wheel build; return its state: built, building or failed."""
    kit, work = Path(args.kit), Path(args.work)
    wheel_dir = work / "wheel"
    if list(wheel_dir.glob("llama_cpp_python-*.whl")):
        return {"state": "built", "wheel": str(next(wheel_dir.glob("llama_cpp_python-*.whl")))}
    pid_file = work / "build.pid"
    if not pid_file.exists():
        work.mkdir(parents=True, exist_ok=True)
        with tarfile.open(kit / "llama-cpp-python-trimmed.tar.gz") as tar:
            tar.extractall(work, filter="data")
        arch = args.cuda_arch or gpu_arch()
        cmake = "-DLLAVA_BUILD=OFF"
        cmake += f" -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES={arch}" if arch and not args.cpu else " -DGGML_NATIVE=ON"
        cmake += f" {args.cmake_extra}" if args.cmake_extra else ""
        env = {**os.environ, "CMAKE_ARGS": cmake, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
        command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                   "-w", str(wheel_dir), str(work / SDIST_NAME)]
        log(f"building llama-cpp-python with CMAKE_ARGS={cmake} (log: {work / BUILD_LOG})")
        with open(work / BUILD_LOG, "w") as out:
            # a new session: the build outlives this command (the next call polls it)
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        pid_file.write_text(str(process.pid))
    deadline = time.monotonic() + args.wait
    pid = int(pid_file.read_text())
    while time.monotonic() < deadline:
        if list(wheel_dir.glob("llama_cpp_python-*.whl")):
            return {"state": "built", "wheel": str(next(wheel_dir.glob("llama_cpp_python-*.whl")))}
        if not _alive(pid):
            tail = (work / BUILD_LOG).read_text(errors="replace")[-3000:]
            return {"state": "failed", "log_tail": tail}
        time.sleep(5)
    return {"state": "building", "log_tail": (work / BUILD_LOG).read_text(errors="replace")[-400:]}


def _alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:  # not our child (an earlier call started it)
        try:
            os.kill(pid, 0)
            return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
        except (ProcessLookupError, FileNotFoundError):
            return False


def install(args) -> dict:
    """Install the built wheel and the carried wheels into KIT/site (put it on PYTHONPATH)."""
    kit, work = Path(args.kit), Path(args.work)
    site = work / "site"
    wheels = sorted(glob.glob(str(kit / "wheels" / "*.whl"))) + sorted(glob.glob(str(work / "wheel" / "*.whl")))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--upgrade", "--target", str(site), *wheels], check=True)
    return {"site": str(site), "wheels": [Path(w).name for w in wheels]}


# ---------------------------------------------------------------------------------------------
# measuring (the device, or a CPU machine)


def models(args) -> dict:
    """Write the shaped target and draft and a tiny random pair, all with the vocab's tokenizer."""
    from specrun.models import synthetic

    out = Path(args.models)
    out.mkdir(parents=True, exist_ok=True)
    vocab = Path(args.vocab) if args.vocab else Path(args.kit) / VOCAB
    made = {}
    targets = {name: synthetic.SHAPES[SHAPE_OF[name]] for name in (*args.targets, "draft-0.5b")}
    if args.fast:  # seconds to write: the architecture and the vocabulary, few and narrow layers
        targets = {name: shape.scaled(n_layer=2, n_embd=256, n_ff=512) for name, shape in targets.items()}
    for name, shape in targets.items():
        path = out / f"{name}-shape.gguf"
        if not path.exists():
            t0 = time.monotonic()
            synthetic.write_shape_model(shape, vocab, path)
            log(f"wrote {path.name} ({path.stat().st_size / 2**30:.2f} GiB) in {time.monotonic() - t0:.0f} s")
        made[name] = str(path)
    for name, seed, layers in (("tiny-target", 1, 4), ("tiny-draft", 2, 2)):
        path = out / f"{name}.gguf"
        if not path.exists():
            synthetic.write_random_model(vocab, path, seed=seed, n_layer=layers, n_embd=128, n_head=4, n_head_kv=2, n_ff=256)
        made[name] = str(path)
    for name in VARIANT_SOURCES:  # the variants step's copies, where written before
        for suffix in VARIANTS:
            if (copy := _variant_path(made[name], suffix)).exists():
                made[f"{name}-{suffix}"] = str(copy)
    return made


VARIANTS = {"f16": "LLAMA_FTYPE_MOSTLY_F16", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}
VARIANT_SOURCES = ("tiny-target", "draft-0.5b")


def _variant_path(src: str | Path, suffix: str) -> Path:
    """Where the variants step writes `src` in another weight type: beside it, `<stem>-<suffix>.gguf`."""
    src = Path(src)
    return src.with_name(f"{src.stem}-{suffix}.gguf")


def variants(args, made: dict) -> dict:
    """F16 and Q8_0 copies of the tiny target and the 0.5B shape (llama.cpp's quantize API), so
    that every common weight type's kernels are probed: `<name>-f16`, `<name>-q8_0` in `made`."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.allow_requantize = True  # the 0.5B shape is Q4_K_M: dequantized, then written anew
    params.nthread = os.cpu_count() or 1
    for name in VARIANT_SOURCES:
        src = Path(made[name])
        for suffix, ftype in VARIANTS.items():
            dst = _variant_path(src, suffix)
            if not dst.exists():
                params.ftype = getattr(llama_cpp, ftype)
                part = dst.with_suffix(".part")
                if llama_cpp.llama_model_quantize(str(src).encode(), str(part).encode(), ctypes.byref(params)):
                    raise SystemExit(f"quantizing {src.name} to {suffix} failed")
                part.rename(dst)
            made[f"{name}-{suffix}"] = str(dst)
    return {name: path for name, path in made.items() if name.endswith(tuple(VARIANTS))}


EXACTNESS_PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 4,",
                     "The quick brown fox", "Translate to German: good morning")
EXACTNESS_BUDGETS = (4, 16, 64, 255)


def exactness(args, made: dict) -> dict:
    """Greedy speculative output vs plain on the tiny random pair, at several tree sizes."""
    import numpy as np

    from specrun.core.sampling import SamplingParams
    from specrun.core.tree_shapes import TreeShape
    from specrun.decoding.stream import token_ids
    from specrun.engine import Batch
    from specrun.runtime.plan import RunOptions
    from specrun.runtime.drafters import BEST_FIRST
    from specrun.runtime.runtime import Runtime, make_decoder
    from specrun.runtime.trees import TreePlan

    opts = RunOptions(target=made[args.exact_target], draft=made[args.exact_draft], ctx_size=1024, lookup=False,
                      quiet=True)
    cases, same, gaps = 0, 0, []
    with Runtime(opts, shape_override=TreeShape(max(EXACTNESS_BUDGETS), 16, 8, 8)) as rt:
        prompts = [rt.tokenize_prompt(p, chat=False) for p in EXACTNESS_PROMPTS]
        plain = [token_ids(make_decoder(None, rt.target, rt.target_ctx), p, SamplingParams(), args.tokens) for p in prompts]
        for budget in EXACTNESS_BUDGETS[::3] if args.fast else EXACTNESS_BUDGETS:
            tree = TreePlan(TreeShape(budget, min(16, budget), min(8, budget), min(8, budget)), BEST_FIRST, "flags")
            decoder = make_decoder(tree, rt.target, rt.target_ctx, rt.draft, rt.draft_ctx, guard=False)
            for prompt, expected in zip(prompts, plain):
                got = token_ids(decoder, prompt, SamplingParams(), args.tokens)
                cases += 1
                if got == expected:
                    same += 1
                    continue
                k = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
                context = prompt + expected[:k]
                rt.target_ctx.clear()
                batch = Batch(len(context), 1)
                batch.set_sequence(context, 0, 0, "last")
                rt.target_ctx.decode(batch)
                top = np.sort(rt.target_ctx.logits_row(-1))[-2:]
                gaps.append({"budget": budget, "position": k, "top2_gap": float(top[1] - top[0])})
                rt.target_ctx.clear()
    return {"pair": [args.exact_target, args.exact_draft], "cases": cases, "identical": same, "divergences": gaps}


def nvidia_smi_used() -> int | None:
    """Return the GPU memory in use in bytes (nvidia-smi), or None without a GPU."""
    if not shutil.which("nvidia-smi"):
        return None
    done = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True)
    return int(done.stdout.split()[0]) * 2**20 if done.returncode == 0 and done.stdout.strip() else None


def plan_check(args, made: dict, out: Path, results: dict) -> list[dict]:
    """Per card: the memory the plan predicts against what the GPU holds once the pair is loaded,
    and, with the pair loaded, the target's and the draft's t(n) for n = 1, 2, 4, ... up to the
    largest tree (+ both sides of each cost step): where the cost jumps and how flat it is. Each
    row is saved as soon as it is measured (a command stopped at its limit keeps what it had)."""
    from specrun.hardware.offload import cost_steps
    from specrun.runtime.plan import RunOptions, build_plan
    from specrun.runtime.runtime import Runtime
    from specrun.tuning.measure import curve_sizes, measure_curve

    rows = results.setdefault("plan", [])
    for target, card, mmap in ((t, c, m) for t in args.targets for c in args.cards for m in args.mmap):
        opts = RunOptions(target=made[target], draft=made["draft-0.5b"], ctx_size=args.ctx, lookup=False,
                          quiet=True, gpu_memory=card * 2**30, budget=args.max_tree, mmap=MMAP[mmap])
        plan = build_plan(opts, detailed=True)
        before = nvidia_smi_used()
        t0 = time.monotonic()
        with Runtime(plan) as rt:
            after = nvidia_smi_used()
            row = {"target": target, "card_gib": card, "mmap": mmap, "plan_mmap": plan.mmap,
                   "op_offload_min_batch": os.environ.get("GGML_OP_OFFLOAD_MIN_BATCH"),
                   "target_gpu_layers": plan.target_gpu_layers,
                   "layer_slots": plan.placement.target_n_slots, "draft_gpu_layers": plan.draft_gpu_layers,
                   "planned_gpu_bytes": list(plan.placement.device_bytes), "planned_ram_bytes": plan.placement.ram_bytes,
                   "measured_gpu_bytes": None if after is None or before is None else after - before,
                   "load_s": round(time.monotonic() - t0, 1)}
            prompt = rt.tokenize_prompt("The history of the printing press begins", chat=False)
            steps = cost_steps(plan.placement)
            for name, model_ctx, largest in (("target_s", rt.target_ctx, args.max_tree + 1), ("draft_s", rt.draft_ctx, 256)):
                if not args.curve or model_ctx is None:
                    continue
                sizes = curve_sizes(min(largest, model_ctx.n_batch), steps if name == "target_s" else ())
                measured = measure_curve(model_ctx, prompt, sizes, repeats=args.curve_repeats,
                                         deadline=time.monotonic() + args.curve_seconds)
                row[name] = {str(n): round(s, 5) for n, s in sorted(measured.decode.items())}
        rows.append(row)
        log(f"plan {target} on {card} GiB, mmap {mmap}: {row}")
        _save(out, results)
    return rows


def reports(args, made: dict, out: Path) -> list[str]:
    """`specrun bench --report` per emulated card; Markdown and JSON files in `out`."""
    written = []
    for target, card in ((t, c) for t in args.targets for c in args.cards):
        for fmt in ("json", "md"):
            command = [sys.executable, "-m", "specrun", "bench", "--report", "--target", made[target],
                       "--draft", made["draft-0.5b"], "--gpu-memory", f"{card}GiB", "--budget", str(args.max_tree),
                       "--max-tokens", str(args.tokens), "--workload", "chat", "--ctx-size", str(args.ctx)]
            if fmt == "json":
                command.append("--json")
            if args.fast:  # one short prompt instead of the chat set
                prompt = out / "kit-prompt.txt"
                prompt.write_text("Say hello.\n")
                command += ["--prompts", str(prompt)]
            path = out / f"report-{target}-{card}gib.{fmt}"
            with open(path, "w") as stdout:
                subprocess.run(command, stdout=stdout, check=True)
            written.append(str(path))
            if args.fast:
                break  # one format is enough to show the step works
    return written


def predict(args, out: Path) -> list[dict]:
    """Per report: the best tree's speedup from its cost curve and a real pair's acceptance
    (--acceptance: a `bench --report --json` of, e.g., the demo pair measured on a CPU)."""
    from specrun.commands.bench_report import predicted_speedup

    tau = json.loads(Path(args.acceptance).read_text())["calibration"]["tau_by_budget"]
    rows = []
    for path in sorted(out.glob("report-*.json")):
        cost = json.loads(path.read_text())["cost"]
        budget, speedup = predicted_speedup(cost["target_s"], tau)
        rows.append({"report": path.name, "largest_tree_under_2x": cost["largest_tree_under_2x"],
                     "steps": cost["steps"], "best_budget": budget, "predicted_speedup": round(speedup, 3)})
        log(f"predicted: {rows[-1]}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("steps", nargs="+", choices=("prepare", "build", "install", "models", "variants", "exactness", "plan",
                                                     "report", "predict", "measure"))
    parser.add_argument("--exact-target", default="tiny-target", help="exactness: the target (a made model's name)")
    parser.add_argument("--exact-draft", default="tiny-draft",
                        help="exactness: the draft (e.g. tiny-target-q8_0 after the variants step: it accepts more)")
    parser.add_argument("--acceptance", default=None,
                        help="predict: a real pair's `bench --report --json` whose acceptance the predictions use")
    parser.add_argument("--kit", default=str(REPO / ".kit"), help="the carried folder (sdist, vocab, wheels)")
    parser.add_argument("--work", default="/tmp/specrun-kit", help="build folder on the device")
    parser.add_argument("--models", default="/tmp/specrun-kit/models")
    parser.add_argument("--out", default=os.environ.get("OUT", "kit-results"))
    parser.add_argument("--vocab", default=None, help=f"GGUF whose tokenizer the models get (default: KIT/{VOCAB})")
    parser.add_argument("--sdist", default=f"/tmp/sdist/{SDIST_NAME}.tar.gz")
    parser.add_argument("--python-version", default="3.12", help="the device's Python, for wheels")
    parser.add_argument("--no-wheels", action="store_true", help="prepare: skip pip download")
    parser.add_argument("--cpu", action="store_true", help="build for the CPU even where a GPU is found")
    parser.add_argument("--cuda-arch", default=None, help="CUDA architecture (default: nvidia-smi's, e.g. 90)")
    parser.add_argument("--cmake-extra", default="",
                        help="build: more CMAKE_ARGS, e.g. -DGGML_CUDA_FA=OFF (half the CUDA kernels: a faster build)")
    parser.add_argument("--wait", type=float, default=540, help="build: seconds to poll before returning")
    parser.add_argument("--fast", action="store_true", help="no build (the installed llama-cpp-python), tiny shapes, short runs (CI)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and short runs after a real build (CPU machines)")
    parser.add_argument("--cards", default="8,12,16,24", help="emulated GPU sizes in GiB")
    parser.add_argument("--mmap", default="auto", help="plan: how the target is loaded, each of auto,on,off "
                        "(off: the layers in RAM sit in pinned host memory)")
    parser.add_argument("--targets", default="dense-27b,moe-30b-a3b", help=f"of {', '.join(list(SHAPE_OF)[:2])}")
    parser.add_argument("--max-tree", type=int, default=2047, help="largest tree whose cost is measured")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--no-curve", dest="curve", action="store_false",
                        help="plan: only the memory, no t(n) curves with the pair loaded")
    parser.add_argument("--curve-repeats", type=int, default=3, help="plan: timed rounds over the curve's sizes")
    parser.add_argument("--curve-seconds", type=float, default=60.0, help="plan: at most this long per curve")
    args = parser.parse_args(argv)
    args.fast = args.fast or args.tiny  # the measuring steps treat both alike
    args.cards = [int(c) for c in args.cards.split(",") if c.strip()]
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    args.mmap = [m.strip() for m in args.mmap.split(",") if m.strip()]
    if any(m not in MMAP for m in args.mmap):
        parser.error(f"--mmap {args.mmap!r}: each of auto, on, off")
    unknown = [t for t in args.targets if t not in SHAPE_OF or t == "draft-0.5b"]
    if unknown:
        parser.error(f"unknown target {unknown[0]!r}: choose from dense-27b, moe-30b-a3b")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = list(args.steps)
    if "measure" in steps:
        measure = ["models", "exactness", "plan", "report"] + (["predict"] if args.acceptance else [])
        steps[steps.index("measure"):steps.index("measure") + 1] = measure
    results: dict = {}
    made: dict = {}
    for step in steps:
        t0 = time.monotonic()
        if step == "prepare":
            results[step] = prepare(args)
        elif step == "build":
            results[step] = build(args)
            if results[step]["state"] != "built":
                log(f"build {results[step]['state']}: {results[step].get('log_tail', '')[-400:]}")
                _save(out, results)
                return 3 if results[step]["state"] == "building" else 1
        elif step == "install":
            results[step] = install(args)
        elif step == "predict":
            results[step] = predict(args, out)
        else:
            made = made or models(args)
            if step == "models":
                results[step] = made
            elif step == "variants":
                results[step] = variants(args, made)
            elif step == "exactness":
                results[step] = exactness(args, made)
            elif step == "plan":
                results[step] = plan_check(args, made, out, results)
            elif step == "report":
                results[step] = reports(args, made, out)
        log(f"{step}: done in {time.monotonic() - t0:.0f} s")
        _save(out, results)
    return 0


def _save(out: Path, results: dict) -> None:
    path = out / "kit-results.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**old, **results}, indent=1))


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
