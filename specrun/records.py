"""Facts measured once and kept in the cache folder, each under the key of what it was measured
on (a model file's version, the llama.cpp build, the options that matter), so that later runs
read it instead of measuring again: llama.cpp's simulated allocations (engine.memory) and whether
a target context's tree passes round as its one-token passes (decoding.kv.chains_alike).

A record is one small JSON file named by a hash of its key, holding the key itself (a hash that
collides, or a record of another key, is not read) beside its figures. The folder keeps the most
recently used records only: a file a new download or a test writes keys records of its own.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from specrun.files import atomic_write_json, read_json
from specrun.paths import cache_dir


class Records:
    """The records of one kind: cache_dir()/`folder`, at most `keep` of them."""

    def __init__(self, folder: str, what: str, keep: int):
        self.folder = folder
        self.what = what  # as a warning about an unreadable record names it
        self.keep = keep

    def path(self, key: dict) -> Path | None:
        """Where the record of `key` is kept (None: the key cannot be written as JSON)."""
        try:
            text = json.dumps(key, sort_keys=True)
        except (TypeError, ValueError):
            return None
        return cache_dir() / self.folder / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"

    def read(self, key: dict) -> dict | None:
        """The record kept under exactly `key` (None: none is), marked as used now."""
        record = self.path(key)
        data = read_json(record, dict, self.what) if record else None
        if data is None or data.get("key") != json.loads(json.dumps(key)):
            return None
        try:
            record.touch()  # (used now: the last the pruning drops)
        except OSError:  # a read-only cache: its records are never pruned either
            pass
        return data

    def store(self, key: dict, data: dict) -> None:
        """Keep `data` under `key`, atomically; a cache that cannot be written only costs the
        next run the measurement."""
        record = self.path(key)
        if record is None:
            return
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(record, {"key": key, **data})
            self.prune()
        except OSError:
            pass

    def prune(self) -> None:
        """Delete the least recently used records beyond `keep` (stored or read: their times;
        another process's deleting them first is fine: each is only a measurement saved)."""
        records = list((cache_dir() / self.folder).glob("*.json"))
        if len(records) <= self.keep:
            return
        stored = []
        for path in records:
            try:
                stored.append((path.stat().st_mtime, path))
            except OSError:
                continue
        for _, old in sorted(stored)[: len(stored) - self.keep]:
            old.unlink(missing_ok=True)
