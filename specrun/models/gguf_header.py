"""Where a GGUF file's header ends, read from its first bytes alone: no library, no weights.

A GGUF file is a header (magic, version, tensor count, key/value count, the key/value pairs, the
tensor infos) followed, at the next multiple of `general.alignment` (32 by default), by the tensor
data. Only the header says how long it is, so a reader given the file's first bytes either finds
the end or says that it needs more bytes. Used to fetch a model's header without its weights
(models.headers); the gguf package cannot help there: its reader maps a whole file.
"""

from __future__ import annotations

import struct

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 counted with 32-bit integers; llama.cpp no longer reads it
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
# A GGUF value's type code -> its size in bytes for fixed-size types; 8 (string) and 9 (array)
# have their own layouts.
FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
INTEGER_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}
MAX_DIMS = 8  # ggml's GGML_MAX_DIMS is 4; anything far above it is not a tensor info


class NotGGUF(ValueError):
    """The bytes are not the start of a GGUF file (or a damaged one)."""


class _NeedMore(Exception):
    """The header goes on past the bytes given."""


def header_length(data: bytes) -> int | None:
    """Return where the tensor data starts in a GGUF file whose first bytes are `data`.

    Returns None when `data` ends before the tensor infos do (give it more bytes); the offset
    returned may lie past the end of `data` by the padding before the data. Raises NotGGUF when
    `data` cannot be the start of a GGUF file.
    """
    try:
        return _Reader(data).data_offset()
    except _NeedMore:
        return None


class _Reader:
    """A cursor over the first bytes of a GGUF file, little-endian as every current file is."""

    def __init__(self, data: bytes):
        self.data = memoryview(data)
        self.pos = 0

    def data_offset(self) -> int:
        if self.take(4) != MAGIC:
            raise NotGGUF("it does not start with the GGUF magic bytes")
        version = self.unpack("<I")
        if version not in VERSIONS:
            raise NotGGUF(f"GGUF version {version} (specrun reads versions {VERSIONS[0]} to {VERSIONS[-1]})")
        n_tensors, n_kv = self.unpack("<Q"), self.unpack("<Q")
        alignment = DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            key = self.string()
            value = self.value(self.unpack("<I"))
            if key == ALIGNMENT_KEY:
                alignment = value
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise NotGGUF(f"{ALIGNMENT_KEY} is {alignment!r}, not a power of two")
        for _ in range(n_tensors):
            self.tensor_info()
        return -(-self.pos // alignment) * alignment

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.data):
            raise _NeedMore
        chunk = self.data[self.pos:end]
        self.pos = end
        return chunk

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.unpack("<Q"))
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise NotGGUF(f"a string at byte {self.pos - len(raw)} is not UTF-8") from None

    def value(self, kind: int):
        """Return an integer value, skip any other (only general.alignment is ever needed)."""
        if kind in INTEGER_FORMATS:
            return self.unpack(INTEGER_FORMATS[kind])
        if kind in FIXED_SIZES:
            self.take(FIXED_SIZES[kind])
        elif kind == STRING:
            self.take(self.unpack("<Q"))
        elif kind == ARRAY:
            self.array()
        else:
            raise NotGGUF(f"unknown value type {kind} at byte {self.pos - 4}")
        return None

    def array(self) -> None:
        kind, count = self.unpack("<I"), self.unpack("<Q")
        if kind in FIXED_SIZES:
            self.take(FIXED_SIZES[kind] * count)  # skipped whole: vocabularies hold 100k+ scores
            return
        if kind not in (STRING, ARRAY):
            raise NotGGUF(f"unknown array element type {kind} at byte {self.pos - 12}")
        for _ in range(count):
            self.value(kind)

    def tensor_info(self) -> None:
        self.take(self.unpack("<Q"))  # the name
        n_dims = self.unpack("<I")
        if n_dims > MAX_DIMS:
            raise NotGGUF(f"a tensor with {n_dims} dimensions at byte {self.pos - 4}")
        self.take(8 * n_dims + 4 + 8)  # the dimensions, the ggml type, the data offset
