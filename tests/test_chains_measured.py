"""Whether greedy trees verify as plain decoding bit for bit is measured on the loaded target, not
assumed from the build (decoding.kv.chains_exact): a tree's first path laid first in a pass with
other branches, against the same tokens in one-token passes, bit for bit (kv.chains_alike). A build
without llamafile runs F32 and Q4_1 targets so and a Q4_K_M one not (docs/exactness.md), so the
answer is measured on every target where it could be true, once per model file, build, placement
and context options, and kept in the cache folder: later starts read it.
"""

from __future__ import annotations

import json

import pytest

from specrun import engine
from specrun.decoding import kv
from specrun.runtime.plan import RunOptions
from specrun.runtime.runtime import Runtime


def _context(path, **options):
    model = engine.Model(path)
    ctx = engine.Context(model, n_ctx=512, n_batch=128, n_seq_max=4, threads=1, **options)
    return model, ctx


def _close(model, ctx) -> None:
    ctx.close()
    model.close()


def _measured(monkeypatch) -> list:
    """Count the measurements made from now on (each still runs)."""
    calls = []
    measure = kv._measure_chains

    def counted(ctx):
        calls.append(ctx)
        return measure(ctx)

    monkeypatch.setattr(kv, "_measure_chains", counted)
    return calls


def test_the_measurement_is_kept_per_model_and_options_and_read_by_the_next_start(offline_models, tmp_path,
                                                                                monkeypatch):
    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path))
    measured = _measured(monkeypatch)
    q4 = offline_models.smollm2_q4
    model, ctx = _context(q4, kv_type="q8_0")
    assert kv.chains_alike(ctx) and len(measured) == 1
    assert ctx.seq_pos_max(0) == -1 and ctx.seq_pos_max(1) == -1  # (the cache left empty)
    _close(model, ctx)
    [record] = (tmp_path / "kernels").glob("*.json")
    kept = json.loads(record.read_text())
    assert kept["alike"] is True and kept["key"]["kv_type"] == "q8_0" and kept["key"]["file"]["size"] == q4.stat().st_size
    # The next start with the same model and options reads it; other options measure their own.
    model, ctx = _context(q4, kv_type="q8_0")
    assert kv.chains_alike(ctx) and len(measured) == 1
    _close(model, ctx)
    model, ctx = _context(q4)  # an f16 cache: tiled attention from 64 query rows, on any build
    assert not kv.chains_alike(ctx) and len(measured) == 2
    _close(model, ctx)
    assert len(list((tmp_path / "kernels").glob("*.json"))) == 2
    # A damaged record is one warning and a new measurement, kept in its place.
    record.write_text("{not json")
    model, ctx = _context(q4, kv_type="q8_0")
    assert kv.chains_alike(ctx) and len(measured) == 3
    _close(model, ctx)
    assert json.loads(record.read_text())["alike"] is True
    # A cache that holds text is not measured (a run's start is), and nothing is kept for it.
    model, ctx = _context(q4, kv_type="q4_0")
    batch = engine.Batch(8, 1)
    batch.set_sequence([1, 2, 3], 0, 0, "last")
    ctx.decode(batch)
    assert not kv.chains_alike(ctx) and len(measured) == 3
    _close(model, ctx)
    assert len(list((tmp_path / "kernels").glob("*.json"))) == 2


def test_only_targets_whose_trees_could_verify_exactly_are_measured(offline_models, tmp_path, monkeypatch):
    # An f16 cache on a build with llamafile sums a tree pass by its size (tinyBLAS, tiled
    # attention): not exact, and not measured. Where the build claims one kernel for every pass
    # size, the claim is measured: on this build the F32 demo target's passes refute it.
    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path))
    measured = _measured(monkeypatch)
    model, ctx = _context(offline_models.smollm2_f32, flash_attn="off")
    claimed = ctx.batch_invariant
    assert kv.chains_exact(ctx) is (claimed and kv.chains_alike(ctx))
    assert len(measured) == int(claimed)
    monkeypatch.setattr("specrun.engine.context.runs_batch_invariant", lambda: True)
    alike = kv.chains_alike(ctx)
    assert kv.chains_exact(ctx) is alike and len(measured) == 1
    assert alike is engine.runs_batch_invariant()  # (F32: tinyBLAS from two tokens where llamafile is built)
    _close(model, ctx)


@pytest.mark.skipif(engine.runs_batch_invariant(), reason="the F32 target's trees do verify exactly on this build")
def test_a_build_claim_the_target_refutes_is_said_at_start_and_trees_verify_as_on_any_build(offline_models,
                                                                                           monkeypatch, capsys):
    # As on a build without llamafile with a K-quant target: the build says one kernel for every
    # pass size, the target's tree passes measure otherwise. The run says so, and its greedy steps
    # keep the acceptance walk (no first-path rule, which holds only where chains are exact).
    monkeypatch.setattr("specrun.engine.context.runs_batch_invariant", lambda: True)
    opts = RunOptions(threads=1, ctx_size=512, quiet=True, flash_attn="off")
    with Runtime(opts) as rt:
        assert not rt.decoder.sizer.chains_exact and not rt.decoder.chain_only
    said = capsys.readouterr().err
    assert "this build computes every pass size with one kernel, yet this target's tree passes" in said, said
    monkeypatch.setattr("specrun.engine.context.runs_batch_invariant", lambda: False)
    with Runtime(opts) as rt:  # no claim: nothing to say (greedy near-ties are docs/exactness.md's)
        assert not rt.decoder.sizer.chains_exact
    assert "tree passes" not in capsys.readouterr().err


def test_on_a_cpu_greedy_trees_keep_their_cells_in_order_and_a_q4_1_targets_answers(offline_models):
    # Where the target's attention runs on this CPU a greedy step lays its tree's first path first
    # and ends where the target leaves it, even where its rows round otherwise (an f16 cache on
    # the default build): the other branches' holes stay after the text instead of being filled by
    # later positions, which moves a quantized model's sums far. Measured here, a tree of 16 from
    # the Q4_1 file drafting for itself, 9 built-in prompts, 96 tokens: 9/9 answers plain
    # decoding's with the rule, 4/9 without (these two prompts parted).
    from specrun.core.sampling import SamplingParams
    from specrun.core.tree_shapes import TreeShape
    from specrun.decoding.stream import make_rng
    from specrun.runtime.drafters import BEST_FIRST
    from specrun.runtime.runtime import make_decoder
    from specrun.runtime.trees import TreePlan

    q4 = str(offline_models.smollm2_q4)
    shape, large = TreeShape(16, 16, 8, 8), TreeShape(64, 16, 8, 8)
    opts = RunOptions(target=q4, draft=q4, ctx_size=1024, lookup=False, quiet=True, threads=2)

    def answer(decoder, prompt):
        steps = list(decoder.steps(prompt, SamplingParams(), 96, make_rng(None)))
        return [t for s in steps for t in s.tokens], steps

    with Runtime(opts, shape_override=large) as rt:
        tree = make_decoder(TreePlan(shape, BEST_FIRST, "flags"), rt.target, rt.target_ctx, rt.draft, rt.draft_ctx,
                            guard=False)
        assert tree.cells_in_order and not tree.sizer.chains_exact  # (f16: not bit for bit, in order)
        # A tree of 64 nodes would take a pass of 65 tokens: the f16 cache's attention tiles such
        # a pass, a row's cells grouped by place (2 of the 9 prompts' answers were plain decoding's),
        # so the step verifies the first 62 nodes, its first path among them (9 of 9).
        wide = make_decoder(TreePlan(large, BEST_FIRST, "flags"), rt.target, rt.target_ctx, rt.draft, rt.draft_ctx,
                            guard=False)
        wide.path_alone = False  # (the whole tree in the pass, as on a GPU: the cut under test)
        prompt = rt.tokenize_prompt("Explain why the sky is blue to a ten-year-old.", chat=True)
        plain, _ = answer(make_decoder(None, rt.target, rt.target_ctx), prompt)
        ours, steps = answer(wide, prompt)
        assert ours == plain and 32 < max(s.tree_nodes for s in steps) <= kv.TILE_ROWS - 2
        for text in ("Explain why the sky is blue to a ten-year-old.",
                     "Write a short story about a lighthouse keeper who finds a message in a bottle."):
            prompt = rt.tokenize_prompt(text, chat=True)
            plain, _ = answer(make_decoder(None, rt.target, rt.target_ctx), prompt)
            ours, steps = answer(tree, prompt)
            assert ours == plain
            drafted = [s for s in steps if s.tree_nodes]
            assert drafted and sum(len(s.tokens) for s in drafted) > 2 * len(drafted)  # (several tokens a pass)
            assert all(s.tree_leaves == 1 for s in drafted)  # (the first path alone in each pass)
            # Some steps left the first path (the last child the target took was not the draft's
            # first) and ended there with its token.
            assert any(s.child_ranks and s.child_ranks[-1] > 1 for s in drafted)
