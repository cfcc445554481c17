"""Hybrid (Gated DeltaNet, short-conv, Mamba), MoE and pure recurrent models: plain decoding and
exact speculation, on tiny random-weight models of the real architectures with the real Qwen3.5
tokenizer (tests/tiny_archs.py).

Random weights make near-uniform, context-dependent distributions with many near-ties: the
strictest exactness test there is. A target whose recurrent state rolls back (qwen35, qwen35moe,
lfm2) verifies one chain per step and rolls the rejected drafts back; one that cannot (jamba,
mamba) decodes plainly and says so in one line.
"""

from __future__ import annotations

import json
import time

import pytest
from tiny_archs import tiny_arch_model

from conftest import MODEL_CACHE
from specrun import architectures, engine
from specrun.core.sampling import SamplingParams, make_rng
from specrun.core.tree_shapes import TreeShape
from specrun.decoding.drafters.best_first import TreeGrower
from specrun.decoding.drafters.hybrid import HybridDrafter
from specrun.decoding.drafters.lookup import LookupDrafter
from specrun.decoding.plain import PlainDecoder
from specrun.decoding.speculative import SpeculativeDecoder
from test_speculative import binned, first_tokens

GREEDY = SamplingParams()
N_CTX = 512
ROLLBACK_ARCHS = ("qwen35", "qwen35moe", "lfm2")
# A text that repeats itself, so lookup drafts are often right and often wrong.
PROMPT = "The cat sat on the mat. The dog sat on the log. The cat sat on the"


@pytest.fixture(scope="module")
def tiny(offline_models):
    """Return {name: path}: each architecture with seed 1, and a second qwen35 (seed 2) as a draft."""
    paths = {arch: tiny_arch_model(MODEL_CACHE, arch) for arch in architectures_under_test()}
    paths["qwen35-draft"] = tiny_arch_model(MODEL_CACHE, "qwen35", seed=2)
    return paths


def architectures_under_test() -> tuple[str, ...]:
    return ("qwen35", "qwen35moe", "lfm2", "gpt-oss", "jamba", "mamba")


_open: list = []


@pytest.fixture(scope="module")
def ctx_of(load_model):
    """Return make(path, **context args) -> (model, a fresh context); all closed after the module."""

    def make(path, n_seq_max: int = 1, n_rs_seq: int = 0, n_batch: int = 64):
        model = load_model(path)
        # One thread: these models are tiny, and two threads spin-wait badly on a busy machine.
        ctx = engine.Context(model, n_ctx=N_CTX, n_batch=n_batch, n_seq_max=n_seq_max, n_rs_seq=n_rs_seq, threads=1)
        _open.append(ctx)
        return model, ctx

    yield make
    for ctx in _open:
        ctx.close()
    _open.clear()


def tokens_of(decoder, prompt, n, params=GREEDY, seed=0) -> list[int]:
    return [t for step in decoder.steps(prompt, params, n, make_rng(seed)) for t in step.tokens]


def spec_decoder(ctx_of, target_path, drafter_kind: str, depth: int, draft_path=None, chains: int = 1):
    """Return a speculative decoder (no speed guard) for a target that verifies up to `chains`
    chains of `depth` drafts (the drafter grows trees of that many branches)."""
    target, ctx = ctx_of(target_path, n_rs_seq=depth, n_seq_max=chains)
    shape = TreeShape.chain(depth) if chains == 1 else TreeShape(chains * depth, depth, chains, chains)
    if drafter_kind == "lookup":
        drafter = LookupDrafter(shape.budget, adapt=False)
    else:
        draft, dctx = ctx_of(draft_path, n_seq_max=shape.budget + 2)
        drafter = TreeGrower(draft, dctx, shape)
        if drafter_kind == "hybrid":
            drafter = HybridDrafter(drafter, shape.budget, shape.budget, draft_depth=depth)
    return target, SpeculativeDecoder(target, ctx, drafter, shape)


def test_tiny_models_load_as_their_architectures(tiny, load_model):
    for arch in architectures_under_test():
        model = load_model(tiny[arch])
        assert model.architecture == arch
        assert model.has_state == architectures.has_state(arch)
        assert model.is_recurrent == architectures.is_recurrent(arch)
    assert architectures.speculation_support("qwen35").shape == "chains"
    assert architectures.speculation_support("jamba").shape == "plain"
    assert architectures.speculation_support("mamba").shape == "plain"
    assert architectures.speculation_support("gpt-oss").shape == "tree"


@pytest.mark.parametrize("arch", ROLLBACK_ARCHS)
@pytest.mark.parametrize("drafter_kind", ["draft", "lookup", "hybrid"])
def test_greedy_chain_speculation_equals_plain_decoding(arch, drafter_kind, tiny, ctx_of):
    """Greedy output of chain verification with rollback is token for token plain decoding's."""
    model, plain_ctx = ctx_of(tiny[arch])
    prompt = model.tokenize(PROMPT)
    reference = tokens_of(PlainDecoder(model, plain_ctx), prompt, 32)
    shapes = {"draft": ((1, 1), (8, 1), (3, 3), (6, 4)), "hybrid": ((3, 1), (6, 4)), "lookup": ((8, 1), (6, 4))}
    for depth, chains in shapes[drafter_kind]:
        _, spec = spec_decoder(ctx_of, tiny[arch], drafter_kind, depth, tiny["qwen35-draft"], chains)
        out = tokens_of(spec, prompt, 32)
        label = f"{arch} {drafter_kind} {chains} chain(s) of {depth}"
        assert out == reference, f"{label}: differs from plain decoding"
        if drafter_kind != "lookup":
            rejected = sum(1 for s in spec.stats.steps if s.tree_nodes > s.accepted)
            assert rejected > 0, f"{label}: a random draft should be rejected (rollbacks exercised)"
            if chains > 1:
                assert max(s.tree_leaves for s in spec.stats.steps) > 1, f"{label}: several chains per step"


def test_target_as_its_own_draft_accepts_whole_chains(tiny, ctx_of):
    """The target drafting for itself: whole chains are accepted, and the output is still plain's."""
    model, plain_ctx = ctx_of(tiny["qwen35"])
    prompt = model.tokenize(PROMPT)
    reference = tokens_of(PlainDecoder(model, plain_ctx), prompt, 30)
    _, spec = spec_decoder(ctx_of, tiny["qwen35"], "draft", 4, tiny["qwen35"])
    assert tokens_of(spec, prompt, 30) == reference
    steps = spec.stats.steps[1:]
    assert sum(s.accepted for s in steps) >= 3 * len(steps) - 4


def test_hybrid_draft_grows_trees_for_an_attention_target(tiny, ctx_of):
    """A hybrid draft (one recurrent state per tree sequence) drafts best-first trees for an
    attention MoE target (gpt-oss): the target verifies whole trees, exactly."""
    from specrun.limits import MAX_SEQ

    model, plain_ctx = ctx_of(tiny["gpt-oss"])
    prompt = model.tokenize(PROMPT)
    reference = tokens_of(PlainDecoder(model, plain_ctx), prompt, 30)
    shape = TreeShape(budget=12, depth=4, width=4, top_k=3)
    _, ctx = ctx_of(tiny["gpt-oss"], n_seq_max=MAX_SEQ)
    draft, dctx = ctx_of(tiny["qwen35-draft"], n_seq_max=shape.budget + 1)
    spec = SpeculativeDecoder(model, ctx, TreeGrower(draft, dctx, shape), shape)
    spec.path_alone = False  # (the whole tree in the pass, its first path read: the tree passes under test)
    assert tokens_of(spec, prompt, 30) == reference
    assert max(s.tree_leaves for s in spec.stats.steps) > 1, "trees, not chains, were verified"


def test_sampling_with_rollback_has_the_plain_distribution(tiny, ctx_of):
    """Chi-square: the first tokens sampled at T=1 through chains with rollback follow plain sampling's."""
    from scipy.stats import chi2_contingency

    params, samples = SamplingParams(temperature=1.0), 200
    model, plain_ctx = ctx_of(tiny["qwen35"])
    plain = PlainDecoder(model, plain_ctx)
    _, spec = spec_decoder(ctx_of, tiny["qwen35"], "draft", 3, tiny["qwen35"])
    prompt = model.tokenize("Once upon a time")
    rng_a, rng_b = make_rng(1), make_rng(2)
    t0 = time.perf_counter()
    plain_samples = [first_tokens(plain, prompt, params, rng_a) for _ in range(samples)]
    spec_samples, accepted = [], 0
    for _ in range(samples):
        spec_samples.append(first_tokens(spec, prompt, params, rng_b))
        accepted += sum(s.accepted for s in spec.stats.steps)
    table = binned(plain_samples, spec_samples)
    p_value = chi2_contingency(table).pvalue
    print(f"\n{samples} samples each in {time.perf_counter() - t0:.1f} s, {table.shape[1]} bins, p = {p_value:.3g}")
    assert accepted > samples / 4, "drafts should be accepted often enough to exercise acceptance"
    assert table.shape[1] >= 5
    assert p_value >= 1e-3, f"sampling through chains differs from plain sampling (p = {p_value:.2g})\n{table}"


@pytest.mark.parametrize("arch", ["qwen35", "mamba"])
def test_three_turns_with_reuse_equal_each_turn_from_scratch(arch, tiny, ctx_of):
    """A conversation of three turns reuses the cached state where the text is a prefix; every
    turn's answer equals the one decoded from an empty cache (plain for mamba, chains for qwen35)."""
    model, ctx = ctx_of(tiny[arch])
    fresh_model, fresh_ctx = ctx_of(tiny[arch])
    if arch == "qwen35":
        _, kept = spec_decoder(ctx_of, tiny[arch], "hybrid", 4, tiny["qwen35-draft"])
    else:
        kept = PlainDecoder(model, ctx)
    fresh = PlainDecoder(fresh_model, fresh_ctx)
    text = model.tokenize("User: hello\nAssistant:")
    reused = []
    for turn in ("How are you?", "Tell me more.", "Thanks."):
        answer = tokens_of(kept, text, 12)
        reused.append(kept.stats.n_prompt - kept.stats.n_prefilled)
        fresh.reset()
        assert answer == tokens_of(fresh, text, 12), f"turn {len(reused)} differs from decoding it from scratch"
        text = text + answer + model.tokenize(f"\nUser: {turn}\nAssistant:", add_special=False)
    assert reused[1] > 0 and reused[2] > 0, f"later turns reuse the cached prefix: {reused}"
    # A prompt that is not an extension of the cached text starts over, and is still right.
    other = model.tokenize("Something else entirely")
    fresh.reset()
    assert tokens_of(kept, other, 8) == tokens_of(fresh, other, 8)


def test_hybrid_that_cannot_roll_back_decodes_plainly_with_one_line(tiny, cli):
    """jamba asked to speculate: plain decoding, the same text as --no-spec, one line saying why."""
    base = ["generate", "--target", str(tiny["jamba"]), "--raw", "-n", "12", "--temperature", "0", "--threads", "1", PROMPT]
    plain = cli(*base, "--no-spec")
    spec = cli(*base, "--draft", str(tiny["qwen35-draft"]))
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout and spec.stdout.strip()
    notes = [line for line in spec.stderr.splitlines() if "plain decoding" in line]
    assert len(notes) == 1 and "cannot roll back" in notes[0], spec.stderr
    lookup = cli(*base, "--draft", "lookup")
    assert lookup.exit_code == 0 and lookup.stdout == plain.stdout


@pytest.mark.parametrize("arch", ["qwen35moe", "mamba", "gpt-oss"])
def test_no_spec_generates_with_every_architecture(arch, tiny, cli):
    result = cli("generate", "--target", str(tiny[arch]), "--raw", "-n", "8", "--no-spec", "--threads", "1", PROMPT)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()


def test_plan_says_chain_or_plain_and_why(tiny, cli):
    chain = cli("plan", "--target", str(tiny["qwen35"]), "--draft", str(tiny["qwen35-draft"]), "--json")
    assert chain.exit_code == 0, chain.output
    data = json.loads(chain.stdout)
    assert data["tree"]["verify"] == "chains"
    assert data["contexts"]["target"]["n_rs_seq"] >= data["tree"]["depth"]
    assert data["contexts"]["target"]["n_seq_max"] == 4
    text = cli("plan", "--target", str(tiny["qwen35"]), "--draft", "lookup")
    assert "chains of up to 8 drafts" in text.stdout and "independent chains, not as one tree" in text.stdout
    plain = cli("plan", "--target", str(tiny["jamba"]), "--draft", str(tiny["qwen35-draft"]))
    assert plain.exit_code == 0
    assert "decoding plain" in plain.stdout and "cannot roll back" in plain.stdout


def test_moe_layers_are_sized_from_the_gguf_header(tiny):
    """A MoE layer's planned bytes hold all its experts (ffn_*_exps), read from the header."""
    from specrun.hardware import placement

    path = tiny["qwen35moe"]
    arch, tensors = engine.gguf_header_facts(path)
    assert arch == "qwen35moe"
    size = placement.model_size(path)
    experts = [sum(b for name, b in tensors.items() if name.startswith(f"blk.{i}.") and "_exps" in name)
               for i in range(size.n_layer)]
    assert all(e > 0 for e in experts)
    for i, layer in enumerate(size.layer_bytes):
        assert layer == sum(b for name, b in tensors.items() if name.startswith(f"blk.{i}."))
        assert layer > experts[i]
    assert size.largest_tensor_bytes == max(b for name, b in tensors.items() if name.startswith("blk."))
    assert size.input_bytes == tensors["token_embd.weight"]
    assert size.output_bytes == tensors["output.weight"] + tensors["output_norm.weight"]
    assert sum(size.layer_bytes) + size.input_bytes + size.output_bytes == sum(tensors.values())
