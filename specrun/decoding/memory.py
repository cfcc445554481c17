"""A memory of what was written: the answers of every request a process served, for lookup.

A request's own lookup index (decoding.lookup_index, a drafter's session text) holds its prompt,
its answer so far and what its drafter served before. Requests decoding in other lanes (`serve
--parallel`, `generate --jsonl --parallel`) each draft with a drafter of their own, so what one
answered the others never saw. Agents and scripts repeat themselves (the same tool call with
other arguments, a file rewritten again, a retried step, a sibling task): one memory per loaded
target (runtime.Runtime), shared by the drafters of all its requests, holds every answer, and
lookup and the hybrid read it beside the request's own index (LookupIndex.propose), without a flag.

How a continuation is scored (after SuffixDecoding, arXiv 2411.04975, which keeps a suffix tree
of earlier outputs beside the request's own): occurrences of the latest tokens are found by
n-gram (MEMORY_ORDERS), then each is measured backward against the request's text, up to
LONGEST tokens. An occurrence weighs ORDER_WEIGHT**(match - 1) with its match capped at
STRONGEST, as an n-gram of that order weighs in the request's own index, times a recency factor
that halves every HALF_LIFE tokens remembered since; continuations that followed more often sum
their weights in the trie. A match of L tokens proposes at most max(MIN_REACH, REACH_PER_TOKEN *
L) tokens: a long match drafts far, a weak one little. The tree the target verifies is sized as
any lookup tree is (decoding.adaptive), and its output stays the target's own. Each answer is
kept with the KEPT_PROMPT prompt tokens before it, the last LEAD of them indexed: the same prompt
sent again, in any lane, matches all of them from its first token (a repeat, decoding.adaptive).

Bounded: at most `max_tokens` tokens are kept (the oldest quarter forgotten when full), in
C * (5 + 8 * len(MEMORY_ORDERS)) bytes and 4 KiB, C the power of two >= max_tokens (LookupIndex's
bound): `nbytes()`.
Thread-safe: requests decoding in threads of their own (decoding.batching) propose and remember
under one lock.

Why not ArcticInference's suffix tree (PyPI `arctic-inference`, the C++ library vLLM calls for
SuffixDecoding): its sdist's setup.py imports torch, its build requires torch==2.10 and protobuf,
and its package is a vLLM plugin; the suffix tree itself is a nanobind module (C++20) that would
need a compiler and a build step of specrun's own. The index here is numpy, bounded in bytes, and
its per-request cost is a few hash-chain walks (checked 2026-11-25, sdist 0.3.0).
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Sequence

import numpy as np

from specrun import paths
from specrun.decoding.lookup_index import MATCH_SPAN, ORDER_WEIGHT, LookupIndex
from specrun.files import atomic_path

# 2**19 tokens (the answers of ~2,000 requests of 200 tokens, each with 64 prompt tokens): 14.5 MiB.
MEMORY_TOKENS = 1 << 19
MEMORY_ORDERS = (8, 4, 2)  # n-grams looked up: a long one finds long matches among many answers
LEAD = 8  # prompt tokens indexed before each answer: its first tokens followed them
# Prompt tokens kept before each answer, LEAD of them indexed, the rest only for measuring a match
# back through them: the same prompt again (in another lane) is a repeat from its first token
# (adaptive.REPEAT_MATCH).
KEPT_PROMPT = MATCH_SPAN
LONGEST = MATCH_SPAN  # tokens a match is measured over, backward
STRONGEST = 8  # a match longer than this weighs no more: it is as good as certain
HALF_LIFE = 1 << 16  # tokens remembered after an occurrence that halve its weight
REACH_PER_TOKEN = 2.0  # tokens a match may propose per token matched
MIN_REACH = 2
# A saved memory (--memory): this line, one line of JSON (whose model, how many tokens and
# answers), then the tokens as little-endian int32, -1 between answers, -2 - t for a prompt token
# t kept unindexed (LookupIndex.history). Files of the version before (every token indexed) are
# read too.
MAGIC = b"specrun memory of answers 2\n"
OLD_MAGIC = b"specrun memory of answers 1\n"


class OutputMemory:
    """Earlier answers of every request of a process, for lookup (see the module doc)."""

    def __init__(self, max_tokens: int = MEMORY_TOKENS):
        self.index = LookupIndex(MEMORY_ORDERS, max_tokens)
        self.answers = 0  # answers remembered
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Tokens kept (separators included)."""
        return len(self.index)

    def nbytes(self) -> int:
        """Return the bytes the memory's arrays hold."""
        with self._lock:
            return self.index.nbytes()

    def stats(self) -> dict:
        """What the memory holds now, as the server reports it: answers, tokens and bytes."""
        with self._lock:
            return {"answers": self.answers, "tokens": len(self.index), "bytes": self.index.nbytes()}

    def remember(self, text: Sequence[int], n_prompt: int) -> None:
        """Keep an answer: `text` is prompt + answer, the answer starting at `n_prompt`."""
        if len(text) <= n_prompt:
            return
        start = max(0, n_prompt - KEPT_PROMPT)
        with self._lock:
            self.index.add_text(text[start:], unindexed=max(0, n_prompt - LEAD - start))
            self.answers += 1

    def continuations(self, context: Sequence[int], depth: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        """Return what followed earlier occurrences of the end of `context` ([m, depth] tokens,
        -1 past each one's reach), their weights, the longest match in tokens over the answers and
        the LEAD prompt tokens before each (up to LONGEST; 0: none), which weighs and reaches and
        which a proposal reports as its order (adaptive.HindsightByKind: from LONG_MATCH tokens a
        kind of its own), and the longest match through all the prompt kept (a repeat:
        adaptive.REPEAT_MATCH)."""
        with self._lock:
            positions, _ = self.index.occurrences(context)
            if len(positions) == 0:
                return np.empty((0, depth), np.int64), np.empty(0), 0, 0
            whole = self.index.match_lengths(positions, context, LONGEST)
            matched = self.index.match_lengths(positions, context, LONGEST, indexed_only=True)
            age = len(self.index) - positions
            weights = ORDER_WEIGHT ** (np.minimum(matched, STRONGEST) - 1.0) * 0.5 ** (age / HALF_LIFE)
            rows, kept = self.index.continuations(positions, np.arange(len(positions)), depth)
        reach = np.maximum(MIN_REACH, np.ceil(REACH_PER_TOKEN * matched[kept]))
        rows[np.arange(depth)[None, :] >= reach[:, None]] = -1
        return rows, weights[kept], int(matched.max()), int(whole.max())

    def match_order(self, context: Sequence[int], at_least: int) -> int:
        """The longest order (`at_least` or more) at which the end of `context` occurred among
        the answers, as LookupIndex.match_order (0: none)."""
        with self._lock:
            return self.index.match_order(context, at_least)


    def save(self, path: Path, model: str) -> None:
        """Write the memory to `path` atomically (the old file or the whole new one), for `model`
        (the identity `load` checks). Raises OSError where it cannot be written."""
        with self._lock:
            history, answers = self.index.history(), self.answers
        head = json.dumps({"model": model, "tokens": len(history), "answers": answers}).encode() + b"\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            f.write(MAGIC + head + history.astype("<i4").tobytes())

    def restore(self, path: Path, model: str, n_vocab: int) -> str | None:
        """Take in the memory `save` wrote to `path` for `model`; return why it was not taken (a
        corrupt or foreign file: the memory stays as it was), None when it was or no file is there."""
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            return f"cannot read {path}: {e.strerror or e}"
        head_end = raw.find(b"\n", len(MAGIC))
        try:
            if not raw.startswith((MAGIC, OLD_MAGIC)) or head_end < 0:
                raise ValueError("not a memory file")
            head = json.loads(raw[len(MAGIC) : head_end])
            if not isinstance(head, dict):
                raise ValueError("no header")
            if head.get("model") != model:
                return f"ignoring the memory of answers {path}: it was written for {head.get('model')!r}, not this model; starting a fresh one"
            tokens = np.frombuffer(raw[head_end + 1 :], "<i4")
            least = -1 if raw.startswith(OLD_MAGIC) else -1 - n_vocab  # (-2 - t: t kept unindexed)
            if len(tokens) != head["tokens"] or (len(tokens) and (tokens.min() < least or tokens.max() >= n_vocab)):
                raise ValueError("its tokens are cut short or not this vocabulary's")
            answers = int(head["answers"])
        except (ValueError, KeyError, TypeError) as e:
            return f"ignoring the memory of answers {path}: it is damaged ({e}); starting a fresh one"
        with self._lock:
            self.index.restore(tokens)
            self.answers += answers
        return None


def memory_path(model: str, scope: str | None = None) -> Path:
    """Where the memory of `model` (an identity: file name, size, vocabulary) is saved, in the
    cache folder; `scope` keeps one apart (the server's API key: one memory per key)."""
    digest = hashlib.sha256(f"{model}\0{scope or ''}".encode()).hexdigest()[:16]
    return paths.memory_dir() / f"{digest}.bin"


def memory_note(memory: OutputMemory, path: Path) -> str:
    """One line on what the memory holds and where it is saved (for --verbose)."""
    return (f"memory of answers: {memory.answers} answers, {len(memory)} tokens, "
            f"{memory.nbytes() / 2**20:.1f} MiB in memory ({path})")


def saved_memories() -> list[dict]:
    """The memories saved in the cache folder (--memory): each one's file, model, answers and
    size, read from its header (a file without one is listed as damaged)."""
    folder = paths.memory_dir()
    found = []
    for path in sorted(folder.glob("*.bin")) if folder.is_dir() else ():
        entry = {"path": str(path), "bytes": path.stat().st_size, "model": None, "answers": None}
        try:
            with open(path, "rb") as f:
                head = f.read(len(MAGIC) + 4096)
            if head.startswith((MAGIC, OLD_MAGIC)):
                fields = json.loads(head[len(MAGIC) :].split(b"\n", 1)[0])
                entry.update(model=fields.get("model"), answers=fields.get("answers"))
        except (OSError, ValueError, AttributeError):
            pass
        found.append(entry)
    return found
