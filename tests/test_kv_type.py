"""--kv-type: the target's KV cache cells, f16 or quantized (llama.cpp's --cache-type-k/-v).

A quantized cache needs flash attention, whose CPU kernel then takes one query row at a time over
the cells in their order: a token's attention no longer depends on where its cells sit in a cache
shared with other sequences, nor on how many tokens its pass holds (docs/exactness.md, "A quantized
KV cache"). These tests check the option end to end and that property on the real demo target.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from specrun import engine
from specrun.engine import memory
from specrun.errors import EngineError
from specrun.runtime.plan import RunOptions, build_plan
from specrun.runtime.runtime import Runtime
from specrun.server.worker import describe
from specrun.tuning import profiles

GB = 1 << 30
OPTS = RunOptions(threads=1, ctx_size=1024, quiet=True)
PROMPT = "List three uses of a paperclip."


def test_the_kv_type_reaches_the_target_the_plan_and_its_simulation(offline_models):
    # The plan, its memory simulation and the loaded context all take the type; the draft keeps
    # f16 (its numbers never reach the answer); llama.cpp itself says which cells it made.
    plan = build_plan(replace(OPTS, kv_type="q8_0"), None, devices=[], ram_free_bytes=16 * GB)
    assert plan.target_ctx.kv_type == "q8_0" and plan.draft_ctx.kv_type is None
    contexts = plan.to_dict()["contexts"]
    assert contexts["target"]["kv_type"] == "q8_0" and contexts["draft"]["kv_type"] == "f16"
    assert contexts["target"]["flash_attn"] == "on"  # (a quantized cache needs it, on any build)
    spec = dict(n_ctx=4096, n_batch=512)
    [f16] = memory.simulate(offline_models.smollm2_f32, [memory.ContextSpec(**spec)])
    [q8] = memory.simulate(offline_models.smollm2_f32, [memory.ContextSpec(**spec, kv_type="q8_0")])
    [q4] = memory.simulate(offline_models.smollm2_f32, [memory.ContextSpec(**spec, kv_type="q4_0")])
    # Q8_0 stores 32 values in 34 bytes, Q4_0 in 18, f16 in 64.
    assert q8.context == pytest.approx(f16.context * 34 / 64, rel=0.02)
    assert q4.context == pytest.approx(f16.context * 18 / 64, rel=0.02)
    with engine.captured_log(quiet=True) as lines, Runtime(plan) as rt:
        assert rt.target_ctx.kv_type == "q8_0" and rt.draft_ctx.kv_type == "f16"
        assert "q8_0 KV cache (--kv-type)" in describe(rt)  # the server's startup line
    said = [line for line in lines if "K (q8_0)" in line]
    assert said, [line for line in lines if "llama_kv_cache" in line]


def test_a_quantized_cache_writes_plain_decodings_text_and_bad_values_are_one_line(cli):
    texts = [cli("generate", "--raw", "-n", "40", "--temperature", "0", "--ctx-size", "512", "--kv-type", "q8_0",
                 *flags, input=PROMPT) for flags in ([], ["--no-spec"])]
    assert all(t.exit_code == 0 for t in texts), [t.output for t in texts]
    assert texts[0].stdout == texts[1].stdout and texts[0].stdout.strip()
    # Where the target's tree passes measured unlike its one-token passes (the F32 demo target on the
    # default build: answers parted from plain decoding's in 3 of 9, docs/exactness.md), it says so.
    warned = "--kv-type q8_0 with speculation" in texts[0].output
    assert warned is not engine.passes_batch_invariant(None, "q8_0") and "with speculation" not in texts[1].output
    plan = cli("plan", "--kv-type", "q4_0", "--ctx-size", "512")
    assert plan.exit_code == 0 and "target KV cache q4_0 (--kv-type)" in plan.stdout, plan.output
    bad = cli("generate", "--kv-type", "q5", input=PROMPT)
    assert bad.exit_code == 2 and "--kv-type 'q5': choose f16, q8_0, q4_0" in bad.output
    off = cli("generate", "--kv-type", "q8_0", "--flash-attn", "off", input=PROMPT)
    assert off.exit_code == 2 and "--kv-type q8_0 needs flash attention" in off.output
    with pytest.raises(EngineError, match="needs flash attention"):
        engine.Context(None, kv_type="q8_0", flash_attn="off")  # (refused before anything opens)


def test_a_tuning_profile_is_kept_apart_for_each_kv_type(offline_models):
    f32, q4 = offline_models.smollm2_f32, offline_models.smollm2_q4
    plain_key = profiles.profile_key(f32, q4, "fp", 2)
    assert "kv_type" not in plain_key  # left to the default: the key profiles had before
    keys = [profiles.profile_key(f32, q4, "fp", 2, kv_type=v) for v in ("f16", "q8_0")]
    assert len({profiles.profile_path(k) for k in (plain_key, *keys)}) == 3
    assert RunOptions(kv_type="q8_0").profile_options()["kv_type"] == "q8_0"


def test_a_quantized_cache_keeps_a_build_without_llamafile_batch_invariant_with_flash_attention(monkeypatch):
    monkeypatch.setattr("specrun.engine.context.runs_batch_invariant", lambda: True)
    assert engine.passes_batch_invariant("off") and not engine.passes_batch_invariant("on")
    assert engine.passes_batch_invariant(None, "q8_0") and engine.passes_batch_invariant("on", "q4_0")
    assert engine.default_flash_attn() == "off" and engine.default_flash_attn("q8_0") == "on"
    monkeypatch.setattr("specrun.engine.context.runs_batch_invariant", lambda: False)
    assert not engine.passes_batch_invariant(None, "q8_0")  # tinyBLAS still sums by the pass's size


def _prompt_and_steps(model, text, kv_type: str, other: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """The last row of a 700-token prompt and of 8 one-token steps after it, in sequence 0 of a
    cache where sequence 1 holds `other` tokens first (0: the sequence alone)."""
    prompt, steps = text[:700], text[700:708]
    with engine.Context(model, n_ctx=2048, n_batch=512, n_seq_max=2, threads=2, kv_type=kv_type) as ctx:
        batch = ctx.new_batch(512, 2)
        if other:
            batch.set_sequence(text[1000:1000 + other], 0, 1, "none")
            ctx.decode(batch)
        for start in range(0, len(prompt), 512):
            batch.set_sequence(prompt[start:start + 512], start, 0, "last")
            ctx.decode(batch)
        last = ctx.logits_row(-1).copy()
        rows = []
        for i, token in enumerate(steps):
            batch.clear()
            batch.add(token, len(prompt) + i, (0,), True)
            ctx.decode(batch)
            rows.append(ctx.logits_row(-1).copy())
    return last, rows


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_where_the_cells_sit_moves_an_f16_caches_logits_and_not_a_quantized_ones(offline_models, kv_type):
    # Measured on the demo target (docs/exactness.md): after another sequence's 37 cells, a
    # 700-token prompt's tiles of 64 cells group its cells otherwise, and every one-token pass over
    # 512 cells or more splits the cache among the threads at other cells; with a quantized cache
    # the kernel reads each row's cells one by one in their order, so nothing moves.
    model = engine.Model(offline_models.smollm2_f32)
    try:
        text = model.tokenize("The quick brown fox jumps over the lazy dog, and then it runs away. " * 120)
        alone = _prompt_and_steps(model, text, kv_type, 0)
        beside = _prompt_and_steps(model, text, kv_type, 37)
    finally:
        model.close()
    same = [np.array_equal(a, b) for a, b in zip([alone[0], *alone[1]], [beside[0], *beside[1]])]
    assert all(same) is (kv_type != "f16"), same


def test_a_q4_1_target_over_a_quantized_cache_verifies_trees_as_plain_decoding_bit_for_bit(offline_models):
    # Its weights have no multi-token kernel and the cache's attention reads cells in order, so a
    # tree's first path laid first scores as one-token passes do (measured at start: kv.chains_alike);
    # the greedy step then keeps what that path chose. Measured before: 5-7 of 9 answers without it.
    from specrun.core.sampling import SamplingParams
    from specrun.core.tree_shapes import TreeShape
    from specrun.decoding.kv import chains_alike
    from specrun.decoding.stream import make_rng
    from specrun.runtime.drafters import BEST_FIRST
    from specrun.runtime.runtime import make_decoder
    from specrun.runtime.trees import TreePlan

    q4 = str(offline_models.smollm2_q4)
    for kv_type, alike in (("f16", False), ("q8_0", True)):
        model = engine.Model(q4)
        with engine.Context(model, n_ctx=512, n_batch=128, n_seq_max=4, threads=2, kv_type=kv_type) as ctx:
            assert chains_alike(ctx) is alike and ctx.seq_pos_max(0) == -1  # (the cache left empty)
        model.close()
    opts = RunOptions(target=q4, draft=q4, ctx_size=1024, lookup=False, quiet=True, threads=2, kv_type="q8_0")

    def answer(decoder, prompt):
        steps = list(decoder.steps(prompt, SamplingParams(logprobs=2), 40, make_rng(None)))
        return [t for s in steps for t in s.tokens], [(lp.logprob, lp.top) for s in steps for lp in s.logprobs]

    with Runtime(opts, shape_override=TreeShape(64, 16, 8, 8)) as rt:
        tree = make_decoder(TreePlan(TreeShape(64, 16, 8, 8), BEST_FIRST, "flags"), rt.target, rt.target_ctx,
                            rt.draft, rt.draft_ctx, guard=False)
        assert tree.sizer.chains_exact
        for text in ("Write a short poem about rain.", "Explain what a compiler does."):
            prompt = rt.tokenize_prompt(text, chat=True)
            plain = answer(make_decoder(None, rt.target, rt.target_ctx), prompt)
            assert answer(tree, prompt) == plain
            assert tree.stats.n_passes < len(plain[0])  # (the trees did verify several tokens a pass)
