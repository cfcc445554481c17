"""Can this draft propose tokens for this target? Both rules in one place.

`check_pair` is the registry's family rule: it catches known mismatches before anything is
downloaded. `check_vocab` is the ground truth once both files are loaded (vocab_only is enough). It follows llama.cpp's own
rule for speculative decoding (common/speculative.cpp): same vocabulary type, same BOS/EOS
handling, sizes within SPEC_VOCAB_MAX_SIZE_DIFFERENCE, identical token texts from id 5 up.
"""

from __future__ import annotations

from pathlib import Path

from specrun import files, paths
from specrun.errors import RegistryError
from specrun.models.specs import ModelSpec

# Small models pad their embedding to a multiple of 128, large ones to 256 (e.g. Qwen2.5 0.5B
# has 151,936 tokens, 7B 152,064): the same tokenizer may differ by exactly 128 in size.
SPEC_VOCAB_MAX_SIZE_DIFFERENCE = 128
# The first ids are control tokens that fine-tunes often rename; llama.cpp skips them too.
SPEC_VOCAB_CHECK_START_TOKEN_ID = 5

VOCAB_TYPES = {0: "none", 1: "SPM", 2: "BPE", 3: "WPM", 4: "UGM", 5: "RWKV", 6: "PLaMo-2"}


def check_pair(target: ModelSpec, draft: ModelSpec) -> None:
    """Raise RegistryError when the registry already knows the two models cannot pair.

    Models of unknown family (paths, hf: references) pass here; the engine's vocabulary
    comparison (check_vocab) decides for them once the files are loaded.
    """
    if target.family and draft.family and target.family != draft.family:
        raise RegistryError(
            f"draft '{draft.name}' (family {draft.family}) cannot draft for target '{target.name}' "
            f"(family {target.family}): their tokenizers differ. Pick a {target.family} draft"
            + (f", e.g. --draft {target.draft}" if target.draft else "")
        )


def check_vocab(target, draft, target_name: str | None = None, draft_name: str | None = None) -> None:
    """Raise RegistryError naming both models and the first difference if draft cannot serve target.

    target, draft: engine.Model objects (vocab_only is enough).
    """
    t_name, d_name = target_name or _name(target), draft_name or _name(draft)

    def refuse(problem: str) -> RegistryError:
        return RegistryError(f"draft {d_name} cannot draft for target {t_name}: {problem}")

    # Reasons in the order a user understands them: tokenizer kind, vocabulary size, then the
    # special-token details that only matter once those agree.
    if target.vocab_type != draft.vocab_type:
        raise refuse(
            f"their tokenizers differ (target {VOCAB_TYPES.get(target.vocab_type, target.vocab_type)}, "
            f"draft {VOCAB_TYPES.get(draft.vocab_type, draft.vocab_type)})"
        )
    difference = abs(target.n_vocab - draft.n_vocab)
    if difference > SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
        raise refuse(
            f"their vocabularies differ in size (target {target.n_vocab} tokens, draft {draft.n_vocab}; "
            f"at most {SPEC_VOCAB_MAX_SIZE_DIFFERENCE} apart)"
        )
    for attr in ("bos", "eos", "add_bos", "add_eos"):
        t_value, d_value = getattr(target, attr, None), getattr(draft, attr, None)
        if t_value != d_value:
            raise refuse(f"their special tokens differ: {attr} is {t_value} in the target, {d_value} in the draft")
    key = _pair_key(target, draft)
    if key is not None and key in _known_pairs():
        return  # these exact files passed before; the text comparison takes ~1 s for 262k tokens
    first = first_text_difference(target, draft)
    if first is not None:
        token, t_text, d_text = first
        raise refuse(f"token {token} is {t_text!r} in the target but {d_text!r} in the draft")
    if key is not None:
        _remember_pair(key)


def first_text_difference(target, draft) -> tuple[int, bytes, bytes] | None:
    """Return (token id, target text, draft text) of the first differing token text, or None."""
    start = SPEC_VOCAB_CHECK_START_TOKEN_ID
    stop = min(target.n_vocab, draft.n_vocab)
    t_texts, d_texts = _token_texts(target, start, stop), _token_texts(draft, start, stop)
    if t_texts == d_texts:  # one C-level comparison of two lists: the common case
        return None
    for offset, (t_text, d_text) in enumerate(zip(t_texts, d_texts)):
        if t_text != d_text:
            return start + offset, t_text, d_text
    return None


def _token_texts(model, start: int, stop: int) -> list[bytes]:
    bulk = getattr(model, "token_texts", None)  # an engine may offer a faster bulk read
    if callable(bulk):
        return list(bulk(start, stop))
    return list(map(model.token_text, range(start, stop)))


def _pairs_file() -> Path:
    return paths.cache_dir() / "vocab_pairs.json"


def _pair_key(target, draft) -> str | None:
    """Return an identity for this pair of files (path, size, mtime), or None without paths."""
    parts = []
    for model in (target, draft):
        path = getattr(model, "path", None)
        if path is None:
            return None
        try:
            key = files.file_key(path)
        except OSError:
            return None
        parts.append(f"{key['path']}:{key['size']}:{key['mtime_ns']}")
    return " | ".join(parts)


def _known_pairs() -> set[str]:
    pairs = files.read_json(_pairs_file(), list, "record of checked model pairs") or []
    return {p for p in pairs if isinstance(p, str)}


def _remember_pair(key: str) -> None:
    try:
        files.atomic_write_json(_pairs_file(), sorted(_known_pairs() | {key}), indent=0)
    except OSError:
        pass  # only a cache: the pair is checked again next time


def _name(model) -> str:
    path = getattr(model, "path", None)
    return str(path) if path is not None else repr(model)
