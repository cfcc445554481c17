"""What every synthetic model's writing shares: a real model's tokenizer copied field by field, and
a file that appears whole or not at all (files.atomic_path).

Needs the `gguf` package, imported only when a model is written.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from specrun.files import atomic_path

TOKENIZER_PREFIX = "tokenizer."


def write_gguf(dst: Path, arch: str, fill: Callable[[Any], None]) -> None:
    """Write a GGUF of `arch` to `dst` atomically: `fill(writer)` adds its keys and tensors."""
    import gguf

    with atomic_path(dst) as tmp:
        writer = gguf.GGUFWriter(tmp, arch=arch)
        fill(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()


@functools.lru_cache(maxsize=2)
def read_tokenizer(path: Path) -> dict[str, tuple[list, Any]]:
    """Return a GGUF's tokenizer fields (read once per process: a large vocabulary takes seconds)."""
    import gguf

    return tokenizer_fields(gguf.GGUFReader(path))


def tokenizer_fields(reader: Any) -> dict[str, tuple[list, Any]]:
    """Return every `tokenizer.*` field of a GGUF as {key: (value types, writable value)}."""
    from gguf import GGUFValueType

    fields = {}
    for key, field in reader.fields.items():
        if not key.startswith(TOKENIZER_PREFIX):
            continue
        types = list(field.types)
        if types[0] == GGUFValueType.ARRAY:
            if len(types) != 2:
                raise ValueError(f"{key}: nested GGUF arrays are not supported")
            # Each element is its own part; `field.data` lists the indices of those parts.
            if types[1] == GGUFValueType.STRING:
                # Keep raw bytes: the writer stores them as they are, so tokens round-trip exactly.
                value = [bytes(field.parts[i]) for i in field.data]
            else:
                value = np.concatenate([field.parts[i] for i in field.data]).tolist()
        elif types[0] == GGUFValueType.STRING:
            value = bytes(field.parts[field.data[0]])
        else:
            value = field.parts[field.data[0]].tolist()[0]
        fields[key] = (types, value)
    if "tokenizer.ggml.tokens" not in fields:
        raise ValueError("base model has no tokenizer.ggml.tokens")
    return fields


def add_tokenizer(writer, tokenizer: dict) -> None:
    """Copy `tokenizer.*` fields (as tokenizer_fields reads them) into a GGUF writer."""
    import gguf

    for key, (types, value) in tokenizer.items():
        sub_type = types[-1] if types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, types[0], sub_type=sub_type)
