"""A model's GGUF header without its weights: header-only sparse copies of Hugging Face files.

`header_copy(spec)` gives a local file that holds a model's real GGUF header and is as long as
the real file, the rest a hole that takes no disk space: enough for llama.cpp to read the model's
metadata and simulate its allocations (no_alloc) before anyone downloads the weights. Every shard
of a split model gets its copy, side by side under its own name, where llama.cpp looks for them.
For a model already downloaded, callers give llama.cpp the real file instead.

The header is fetched with HTTP range requests, with the hub's endpoint, token and revision as
downloads use them (models.hub). Its length is known only once it is parsed, so a first range is
read and the bytes read are doubled until the header is whole (models.gguf_header). The copies
live in specrun's cache, `<cache>/headers/<owner>/<repo>/<commit>/<file>`, with
`refs/<revision>` naming the commit as in the Hugging Face cache; once there they are used
without asking the hub again, online or offline.
"""

from __future__ import annotations

import http.client
import os
import re
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from specrun import paths
from specrun.errors import DownloadError
from specrun.files import atomic_write_text, human_size
from specrun.models import hub
from specrun.models.download import READ_TIMEOUT, total_size
from specrun.models.gguf_header import NotGGUF, header_length
from specrun.models.specs import HFSource, ModelSpec

# The first range read. Headers are mostly the vocabulary, 25 to 37 bytes a token (with its merges):
# SmolLM2's 49k tokens make 1.8 MB, read as 2 MiB; Gemma 3's 262k make 6.5 MB, read as 8 MiB.
FIRST_RANGE = 1 << 20
# Real headers stay far below this; bytes still not parsed by then are not a GGUF header.
MAX_HEADER = 1 << 28
COMMIT_RE = re.compile(r"[0-9a-f]{40}")


def header_copy(spec: ModelSpec) -> tuple[Path | None, str | None]:
    """Return (a header-only sparse copy of the model's first shard, None), or (None, why not)."""
    try:
        return fetch_header_copy(spec), None
    except DownloadError as e:
        return None, str(e)


def fetch_header_copy(spec: ModelSpec) -> Path:
    """Return a header-only sparse copy of the model's first shard, from its Hugging Face sources.

    Raises DownloadError with one line that says why no copy can be had (offline without a
    cached header, a gated repo without a token, a missing file, a file that is not a GGUF...).
    """
    sources = [src for src in spec.sources if isinstance(src, HFSource)]
    if not sources:
        raise DownloadError(f"{spec.name} comes from {spec.sources[0].describe()}, not a Hugging Face repo: "
                            "its header cannot be fetched without the whole file")
    errors = []
    for src in sources:
        try:
            return _source_copy(spec, src)
        except DownloadError as e:
            errors.append(e)
        except OSError as e:
            raise DownloadError(f"cannot write the header copy of {spec.name} under {headers_dir()}: "
                                f"{e.strerror or e}") from None
    raise errors[0]


def headers_dir() -> Path:
    """Return where header-only copies are kept: <specrun cache>/headers."""
    return paths.cache_dir() / "headers"


def _source_copy(spec: ModelSpec, src: HFSource) -> Path:
    """Return the first shard's copy for one source, fetching the headers of the shards missing."""
    repo_dir = headers_dir() / src.repo
    ref = repo_dir / "refs" / _folder_name(src.revision)
    commit = ref.read_text().strip() if ref.is_file() else None
    if commit and all((repo_dir / commit / name).is_file() for name in src.files):
        return repo_dir / commit / src.files[0]
    if hub.hf_offline():
        weights = f", not the {human_size(spec.size)} of weights" if spec.size else ""
        raise DownloadError(f"the GGUF header of {spec.name} is not cached and HF_HUB_OFFLINE is set: unset it "
                            f"to fetch the header alone (a few MB{weights}) from {src.describe()}")
    for i, name in enumerate(src.files):  # every shard from the commit of the first
        if not commit or not (repo_dir / commit / name).is_file():
            commit = _fetch_copy(spec, src, i, commit, repo_dir)
    atomic_write_text(ref, commit + "\n")
    return repo_dir / commit / src.files[0]


def _fetch_copy(spec: ModelSpec, src: HFSource, i: int, commit: str | None, repo_dir: Path) -> str:
    """Fetch shard i's header, write its sparse copy under repo_dir/<commit>; return the commit."""
    name = src.files[i]
    link = hub.hf_file_link(spec, src, name, commit or src.revision)
    header, size = _read_header(src, name, link)
    size = size or (src.sizes[i] if src.sizes else None)
    if size is None:
        raise DownloadError(f"{src.repo} does not say how large {name} is, so no copy of its size can be made")
    if not commit:
        commit = link.commit if COMMIT_RE.fullmatch(link.commit or "") else _folder_name(src.revision)
    _write_sparse(repo_dir / commit / name, header, size)
    return commit


def _folder_name(revision: str) -> str:
    """Return a revision (a branch, a tag, a commit) as one folder name."""
    return urllib.parse.quote(revision, safe="")


def _read_header(src: HFSource, name: str, link: hub.HFFileLink) -> tuple[bytes, int | None]:
    """Return a file's GGUF header bytes, read by doubling ranges, and the size the server gave."""
    data, size = b"", link.size
    while True:
        try:
            end = header_length(data)
        except NotGGUF as e:
            raise DownloadError(f"{name} from {src.repo} is not a GGUF file that specrun can read ({e})") from None
        if end is not None and end <= len(data):
            return data[:end], size
        want = end or max(FIRST_RANGE, 2 * len(data))
        if size is not None and len(data) >= size:
            raise DownloadError(f"{name} from {src.repo} ends inside its GGUF header: the file is damaged")
        if want > MAX_HEADER:
            raise DownloadError(f"{name} from {src.repo} has no GGUF header end in its first "
                                f"{human_size(MAX_HEADER)}: it is damaged or not a GGUF file")
        chunk, served_size = _read_range(src, name, link, len(data), min(want, size or want))
        data, size = data + chunk, size or served_size


def _read_range(src: HFSource, name: str, link: hub.HFFileLink, start: int, stop: int) -> tuple[bytes, int | None]:
    """Return bytes [start, stop) of a file (fewer if it ends first) and the file's size if known."""
    request = urllib.request.Request(
        link.url, headers={**link.headers, "Accept-Encoding": "identity", "Range": f"bytes={start}-{stop - 1}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=READ_TIMEOUT) as response:
            skip = 0 if response.status == 206 else start  # a server that ignores Range sends it all
            body = response.read(skip + stop - start)[skip:]
            size = total_size(response, start if response.status == 206 else 0)
    except urllib.error.HTTPError as e:
        raise DownloadError(f"Hugging Face answered HTTP {e.code} to a range request for {name} from "
                            f"{src.repo}; try again later") from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        reason = getattr(e, "reason", None) or e
        raise DownloadError(f"reading the header of {name} from {src.repo} failed ({reason}); try again") from None
    if not body:
        raise DownloadError(f"{src.repo} sent no bytes of {name} from byte {start}; try again later")
    return body, size


def _write_sparse(path: Path, header: bytes, size: int) -> None:
    """Write header, then a hole up to size, to path atomically: it takes the header's disk space only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.truncate(size)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
