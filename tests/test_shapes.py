"""Random-weight models of real shapes (`specrun pull qwen2.5-14b-shape`): the full-size plan matches
the real Q4_K_M files byte for byte within the tokenizer's size; a scaled-down copy is built,
loaded and run by llama.cpp."""

from __future__ import annotations

import json

import pytest

from specrun.hardware import placement
from specrun.models import registry, synthetic


def test_full_size_shapes_match_the_real_q4_k_m_files():
    for name in ("qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b"):
        real = registry.resolve(name).size
        assert synthetic.file_bytes(synthetic.SHAPES[name]) == pytest.approx(real, rel=0.002), name  # metadata aside
    # Qwen3-30B-A3B at Q4_K_M: 18.6 GB as published
    assert synthetic.file_bytes(synthetic.SHAPES["qwen3-30b-a3b"]) == pytest.approx(18.6e9, rel=0.01)
    assert registry.resolve("qwen2.5-14b-shape").sources[0].shape == "qwen2.5-14b"


def test_q4_k_m_keeps_more_bits_where_llama_cpp_does():
    plan = {name: kind for name, _, kind in synthetic.tensor_plan(synthetic.SHAPES["qwen2.5-14b"])}
    six = [i for i in range(48) if plan[f"blk.{i}.ffn_down.weight"] == "Q6_K"]
    assert six[:6] == [0, 1, 2, 3, 4, 5] and six[-6:] == list(range(42, 48)) and len(six) == 24
    assert plan["output.weight"] == "Q6_K" and plan["blk.7.ffn_up.weight"] == "Q4_K"
    narrow = {name: kind for name, _, kind in synthetic.tensor_plan(synthetic.SHAPES["qwen2.5-0.5b"])}
    assert narrow["blk.7.attn_q.weight"] == "Q5_0"  # 896 wide: no room for 256-weight k-quant blocks
    assert "output.weight" not in narrow and narrow["token_embd.weight"] == "Q8_0"  # tied, output's type


def _user_models(text: str) -> None:
    from specrun import paths

    path = paths.user_models_toml()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _cached(name: str):
    from specrun import paths

    return paths.models_dir() / name


def test_pull_a_scaled_shape_and_run_it(offline_models, cli):
    _user_models(
        '[models.tiny-14b-shape]\nfamily = "smollm2"\nquant = "Q4_K_M"\ndraft = false\n'
        '[[models.tiny-14b-shape.source]]\nderived = "smollm2-135m-q4"\nop = "shape"\nshape = "qwen2.5-14b"\n'
        'scaled = [2, 256, 512]\nfile = "test-tiny-14b-shape.gguf"\n'
    )
    pulled = cli("pull", "--quiet", "tiny-14b-shape")
    assert pulled.exit_code == 0, pulled.output
    size = placement.model_size(pulled.stdout.strip())
    assert (size.n_layer, size.n_embd, size.n_vocab) == (2, 256, 152064)  # the 14B's vocabulary, padded
    run = cli("generate", "--target", "tiny-14b-shape", "--no-spec", "--raw", "-n", "4", "--ctx-size", "256", "Hello")
    assert run.exit_code == 0, run.output
    # a mixture of experts (qwen3moe), its draft the dense one: a tree over random weights stays exact
    _user_models(
        '[models.tiny-14b-shape]\nfamily = "smollm2"\ndraft = false\n'
        '[[models.tiny-14b-shape.source]]\nderived = "smollm2-135m-q4"\nop = "shape"\nshape = "qwen2.5-14b"\n'
        'scaled = [2, 256, 512]\nfile = "test-tiny-14b-shape.gguf"\n'
        '[models.tiny-moe-shape]\nfamily = "smollm2"\ndraft = false\n'
        '[[models.tiny-moe-shape.source]]\nderived = "smollm2-135m-q4"\nop = "shape"\nshape = "qwen3-30b-a3b"\n'
        'scaled = [2, 256, 256]\nfile = "test-tiny-moe-shape.gguf"\n'
    )
    args = ("generate", "--target", "tiny-moe-shape", "--raw", "-n", "6", "--ctx-size", "256", "--json", "Hello")
    tree = cli(*args, "--draft", "tiny-14b-shape", "--budget", "8", "--no-lookup")
    plain = cli(*args, "--no-spec")
    assert tree.exit_code == 0 and plain.exit_code == 0, tree.output + plain.output
    assert json.loads(tree.stdout)["text"] == json.loads(plain.stdout)["text"]
    moe = placement.model_size(_cached("test-tiny-moe-shape.gguf"))
    assert (moe.n_layer, moe.n_embd, moe.n_vocab) == (2, 256, 151936)
    for source, message in (('shape = "qwen2.5-14b"\nscaled = [2, 256]', "scaled must be [n_layer, n_embd, n_ff]"),
                            ('shape = "qwen9-1t"', "unknown model shape 'qwen9-1t'")):
        _user_models(f'[models.odd-shape]\nfamily = "smollm2"\n[[models.odd-shape.source]]\nderived = "smollm2-135m-q4"\nop = "shape"\n{source}\n')
        bad = cli("pull", "odd-shape")
        assert bad.exit_code != 0 and message in bad.output and "Traceback" not in bad.output
