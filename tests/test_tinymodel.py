"""The random-weight draft: same tokenizer as its base, loads in llama.cpp, mostly disagrees."""

from __future__ import annotations

import itertools
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from llama_cpp import Llama

from specrun.engine import compute
from specrun.models.synthetic import tiny_llama, write_random_model

PROMPT = "The capital of France is"
N_GENERATED = 20
SAMPLE_TEXTS = [
    "Hello, world!",
    "  leading spaces, ünïcödé and an emoji 🤖",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "def square(x):\n    return x ** 2\n",
]


@pytest.fixture(scope="module")
def tiny_path(smollm2_q4_path, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_random_model(smollm2_q4_path, path, seed=0)
    return path


def load_llama(path: Path) -> Llama:
    """Return llama-cpp-python's high-level model, without ggml's extra buffer types.

    On CPUs with AMX, ggml's AMX matmul (an extra buffer type) segfaults on Q4_1 weights in the
    vendored llama.cpp; engine.Model turns it off the same way. Llama() has no option for it.
    """
    default_params = llama_cpp.llama_cpp.llama_model_default_params

    def params_without_extra_bufts():
        params = default_params()
        params.use_extra_bufts = False
        return params

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llama_cpp.llama_cpp, "llama_model_default_params", params_without_extra_bufts)
        return Llama(str(path), n_ctx=256, verbose=False)


@pytest.fixture(scope="module")
def base_llm(smollm2_q4_path):
    llm = load_llama(smollm2_q4_path)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def tiny_llm(tiny_path):
    llm = load_llama(tiny_path)
    yield llm
    llm.close()


def greedy_tokens(llm: Llama, prompt: str, n: int) -> list[int]:
    tokens = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    # In the compute thread, as every pass of specrun's (test_plain._llama_greedy says why).
    return compute.run(lambda: list(itertools.islice(llm.generate(tokens, top_k=1, temp=0.0), n)))


def test_tiny_model_has_the_base_vocabulary(base_llm, tiny_llm):
    assert tiny_llm.n_vocab() == base_llm.n_vocab() == 49152
    assert (tiny_llm.token_bos(), tiny_llm.token_eos()) == (base_llm.token_bos(), base_llm.token_eos())
    for text in SAMPLE_TEXTS:
        for add_bos in (False, True):
            expected = base_llm.tokenize(text.encode(), add_bos=add_bos, special=True)
            assert tiny_llm.tokenize(text.encode(), add_bos=add_bos, special=True) == expected, text
    sample_ids = list(range(0, base_llm.n_vocab(), 97))
    assert [tiny_llm.detokenize([i]) for i in sample_ids] == [base_llm.detokenize([i]) for i in sample_ids]


def test_tiny_model_generates_varied_tokens_that_disagree_with_the_base(base_llm, tiny_llm):
    tiny = greedy_tokens(tiny_llm, PROMPT, N_GENERATED)
    base = greedy_tokens(base_llm, PROMPT, N_GENERATED)
    assert len(tiny) == N_GENERATED
    assert len(set(tiny)) > 1, "random model stuck on one token"
    agreements = sum(t == b for t, b in zip(tiny, base))
    assert agreements < N_GENERATED // 4, (tiny, base)


def test_tiny_model_has_llama_metadata(tiny_llm):
    meta = tiny_llm.metadata
    assert meta["general.architecture"] == "llama"
    assert int(meta["llama.context_length"]) >= 4096
    assert int(meta["llama.vocab_size"]) == 49152
    assert meta["tokenizer.chat_template"].startswith("{% for message in messages %}")


def test_same_seed_writes_identical_bytes(smollm2_q4_path, tiny_path, tmp_path):
    again, other_seed = tmp_path / "again.gguf", tmp_path / "seed1.gguf"
    write_random_model(smollm2_q4_path, again, seed=0)
    write_random_model(smollm2_q4_path, other_seed, seed=1)
    assert again.read_bytes() == tiny_path.read_bytes()
    assert other_seed.read_bytes() != tiny_path.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.gguf", "seed1.gguf"], "temp files left"


def test_failed_write_keeps_the_previous_file_and_leaves_no_temp(smollm2_q4_path, tmp_path, monkeypatch):
    dst = tmp_path / "tiny.gguf"
    dst.write_bytes(b"previous model")

    def failing_tensors(*args):
        yield "token_embd.weight", np.zeros((4, 4), dtype=np.float32)
        raise MemoryError("simulated failure while writing")

    monkeypatch.setattr(tiny_llama, "_random_tensors", failing_tensors)
    with pytest.raises(MemoryError):
        write_random_model(smollm2_q4_path, dst)
    assert dst.read_bytes() == b"previous model"
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.gguf"]


def test_base_that_is_not_gguf_is_refused(tmp_path):
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"this is not a gguf file" * 10)
    with pytest.raises(ValueError):
        write_random_model(not_gguf, tmp_path / "tiny.gguf")
    assert not (tmp_path / "tiny.gguf").exists()
