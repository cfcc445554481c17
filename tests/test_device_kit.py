"""The device kit (scripts/device_kit.sh, scripts/device_kit.py): the trimmed sdist keeps what the
library build reads, and the kit's measuring steps run end to end on this CPU in --fast mode
(the installed llama-cpp-python, scaled-down shapes, one emulated card)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import device_kit  # noqa: E402


def _fake_sdist(path: Path) -> None:
    root = f"{device_kit.SDIST_NAME}/"
    llama = root + "vendor/llama.cpp/"
    files = ["CMakeLists.txt", "llama_cpp/__init__.py", "docs/index.md", "tests/test_llama.py", ".git/objects/pack.pack",
             llama + "CMakeLists.txt", llama + "src/llama.cpp", llama + "common/common.cpp", llama + "vendor/stb/stb.h",
             llama + f"models/{device_kit.VOCAB}", llama + "models/ggml-vocab-gemma-4.gguf", llama + "docs/build.md",
             llama + "tools/ui/bundle.js", llama + "tools/mtmd/mtmd.cpp", llama + "examples/x.cpp",
             llama + "ggml/src/ggml.c", llama + "ggml/src/ggml-cpu/ggml-cpu.c", llama + "ggml/src/ggml-cuda/fattn.cu",
             llama + "ggml/src/ggml-vulkan/vk.cpp", llama + "ggml/src/ggml-sycl/sycl.cpp", llama + "convert_hf_to_gguf.py"]
    with tarfile.open(path, "w:gz") as tar:
        for name in files:
            name = name if name.startswith(root) else root + name
            data = name.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_the_trimmed_sdist_keeps_the_library_sources_only(tmp_path):
    sdist = tmp_path / "sdist.tar.gz"
    _fake_sdist(sdist)
    kit = tmp_path / "kit"
    kit.mkdir()
    tarball = device_kit.trim_sdist(sdist, kit)
    with tarfile.open(tarball) as tar:
        kept = {m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile()}
    llama = "vendor/llama.cpp/"
    assert {"CMakeLists.txt", "llama_cpp/__init__.py", llama + "CMakeLists.txt", llama + "src/llama.cpp", llama + "common/common.cpp",
            llama + "vendor/stb/stb.h", llama + "ggml/src/ggml.c", llama + "ggml/src/ggml-cpu/ggml-cpu.c",
            llama + "ggml/src/ggml-cuda/fattn.cu"} == kept
    assert (kit / device_kit.VOCAB).read_bytes() == f"{device_kit.SDIST_NAME}/{llama}models/{device_kit.VOCAB}".encode()


def test_the_kit_runs_end_to_end_on_the_cpu(tmp_path, offline_models):
    env = {**os.environ, "KIT": str(tmp_path / "kit"), "WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "out"),
           "PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "device_kit.sh"), "--fast", "--vocab", str(offline_models.smollm2_q4),
         "--cards", "2", "--max-tree", "4", "--tokens", "4", "--ctx", "512", "--targets", "moe-30b-a3b"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "kit-results.json").read_text())
    exact = results["exactness"]
    assert exact["cases"] == 2 * len(device_kit.EXACTNESS_PROMPTS) and exact["identical"] == exact["cases"]
    (card,) = results["plan"]
    assert card["card_gib"] == 2 and card["layer_slots"] == 3 and card["measured_gpu_bytes"] is None  # no GPU here
    # the pair's cost curves, measured with it loaded: one-token passes first, every time positive
    for curve in (card["target_s"], card["draft_s"]):
        assert {1, 2, 4} <= set(map(int, curve)) and all(s > 0 for s in curve.values())
    report = json.loads((tmp_path / "out" / "report-moe-30b-a3b-2gib.json").read_text())
    assert report["placement"]["gpu_memory_limit_bytes"] == 2 << 30
    assert sorted(map(int, report["cost"]["target_s"])) == [1, 2, 4, 8]
    assert all(row["identical_output"] for row in report["workloads"])
    # predictions: this report's cost curve with an acceptance curve (here its own)
    predicted = subprocess.run([sys.executable, str(REPO / "scripts" / "device_kit.py"), "predict", "--out",
                                str(tmp_path / "out"), "--acceptance", str(tmp_path / "out" / "report-moe-30b-a3b-2gib.json")],
                               env=env, capture_output=True, text=True, timeout=120)
    assert predicted.returncode == 0, predicted.stderr[-2000:]
    (row,) = json.loads((tmp_path / "out" / "kit-results.json").read_text())["predict"]
    assert row["report"] == "report-moe-30b-a3b-2gib.json" and row["predicted_speedup"] >= 1.0


def test_the_variants_step_writes_f16_and_q8_0_copies_that_decode_as_a_pair(tmp_path, offline_models):
    """`variants` quantizes the tiny target and the 0.5B shape with llama.cpp's API (the probe's
    weight types), and `exactness --exact-draft` takes such a copy as the tiny target's draft."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    common = ["--fast", "--vocab", str(offline_models.smollm2_q4), "--targets=", "--tokens", "8",
              "--models", str(tmp_path / "models"), "--out", str(tmp_path / "out")]
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "device_kit.py"), "models", "variants", *common],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    made = json.loads((tmp_path / "out" / "kit-results.json").read_text())["variants"]
    assert set(made) == {f"{m}-{v}" for m in ("tiny-target", "draft-0.5b") for v in ("f16", "q8_0")}
    import gguf

    for name, path in made.items():  # llama.cpp's file types: 1 MOSTLY_F16, 7 MOSTLY_Q8_0
        field = gguf.GGUFReader(path).fields["general.file_type"]
        assert int(field.parts[field.data[0]][0]) == {"f16": 1, "q8_0": 7}[name.rsplit("-", 1)[1]]
    # a later call finds the copies again (`models` lists them), and the pair decodes
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "device_kit.py"), "exactness", *common,
                           "--exact-draft", "tiny-target-q8_0"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    exact = json.loads((tmp_path / "out" / "kit-results.json").read_text())["exactness"]
    assert exact["pair"] == ["tiny-target", "tiny-target-q8_0"]
    assert exact["cases"] == 2 * len(device_kit.EXACTNESS_PROMPTS)
    assert exact["identical"] + len(exact["divergences"]) == exact["cases"]


def test_the_batch_invariance_probe_reads_a_model_file_and_follows_a_row_through_the_graph(offline_models):
    """What the device runs: the probe on a GGUF path with its layers where --n-gpu-layers puts
    them (none here), small chains among the shapes, and the op trace read through ggml's
    tensor_get (a GPU's memory too): every row of the table filled."""
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "batch_invariance_probe.py"), "--models",
                           str(offline_models.smollm2_random), "--n-gpu-layers", "0", "--ops", "--shapes", "chain2",
                           "chain8", "scattered", "--context", "600"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "GPU layers 0; context 600;" in done.stdout  # 600 cells of earlier text: past one-token split points
    mine = [line for line in done.stdout.splitlines() if line.startswith(f"| {offline_models.smollm2_random.name} |")]
    rows = {cells[2]: cells[3:8] for cells in ([c.strip() for c in line.split("|")] for line in mine)}
    assert set(rows) == {"chain2", "chain8", "scattered"}
    for shape, (worst, differing, flips, gap, op) in rows.items():
        n_diff, n_rows = map(int, differing.split("/"))
        assert n_rows == 128 and int(flips) >= 0 and float(gap) >= 0
        assert (float(worst) > 0) == (n_diff > 0)
        if n_diff and shape.startswith("chain"):  # the first op whose row differs, with its difference
            assert op.startswith("`") and float(op.rsplit("(", 1)[1].rstrip(")")) > 0


def test_the_prefill_probe_measures_prompts_beside_others_and_resumed_inside_a_batch(offline_models):
    """scripts/prefill_alike_probe.py on a model file (the probe docs/exactness.md's "Prefill against
    prefill" table comes from): every case of both kinds is a row, and on this CPU with flash
    attention the cells of a chunk in a pass under 64 tokens, and a prompt resumed in a pass of 64
    or more after a cached chunk of 64 or more, come out bit for bit as alone and as fresh, while a
    resumed pass under 64 tokens after a cached chunk of 200 does not (another kernel)."""
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "prefill_alike_probe.py"), "--models",
                           str(offline_models.smollm2_random)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    mine = [line for line in done.stdout.splitlines() if line.startswith(f"| {offline_models.smollm2_random.name} |")]
    rows = {cells[2]: (float(cells[3]), float(cells[4])) for cells in ([c.strip() for c in line.split("|")] for line in mine)}
    beside = {case: diff for case, diff in rows.items() if case.startswith("beside:")}
    resumed = {case: diff for case, diff in rows.items() if case.startswith("resumed:")}
    assert len(beside) == 7 and len(resumed) == 6, done.stdout
    under_64 = [diff for case, diff in beside.items() if int(case.rsplit("a pass of ", 1)[1].rstrip(")")) < 64]
    assert len(under_64) == 5 and all(cells == 0 for _, cells in under_64)
    assert resumed["resumed: cached chunk 200, 150 of it kept, a pass of 150 (fresh: 300)"] == (0, 0)
    assert resumed["resumed: cached chunk 100, 64 of it kept, a pass of 64 (fresh: 128)"] == (0, 0)
    assert max(resumed["resumed: cached chunk 200, 190 of it kept, a pass of 40 (fresh: 230)"]) > 0
