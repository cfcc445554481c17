"""Flash attention for an untuned target on a CPU (tuning.flash_attention): a run opens the
target's context without it, one request at a time, where an estimate from a probe of this CPU's
attention at the target's shape says its passes pay off without it and the target's passes round
as alike without it; measured once on the real demo models and kept in the cache folder."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from specrun import engine, ui
from specrun.decoding.pay.rules import attention_off_rounds_alike
from specrun.models.synthetic import write_attention_model
from specrun.runtime.plan import RunOptions, build_plan
from specrun.tuning import flash_attention
from specrun.tuning.attention import AttentionCosts, save_record
from specrun.tuning.flash_attention import estimated_costs, probes, record_key, rounds_alike_without, rounding, scaled


def _plan(opts):
    return build_plan(opts, None, devices=[], ram_free_bytes=16 * 2**30)


def test_the_probes_model_has_the_heads_it_was_asked_for(tmp_path):
    path = tmp_path / "heads.gguf"
    write_attention_model(path, 2, 9, 3, 64)
    with engine.Model(path) as model:
        assert (model.n_layer, model.n_head, model.n_head_kv) == (2, 9, 3)
        assert model.meta("llama.attention.key_length") == "64" and model.n_embd == 64
        with engine.Context(model, n_ctx=64, n_batch=16, threads=1) as ctx:  # (it runs: ids only, no tokenizer)
            batch = engine.Batch(16, 1)
            batch.set_sequence(list(range(1, 17)), 0, 0, "all")
            ctx.decode(batch)
            assert ctx.logits().shape == (16, model.n_vocab)
    with pytest.raises(ValueError, match="not an attention"):
        write_attention_model(tmp_path / "bad.gguf", 2, 9, 2, 64)  # (9 heads do not share 2 groups)


def test_an_estimate_adds_the_scaled_attention_to_the_targets_own_passes():
    ms = lambda *f: dict(zip((1, 8, 16), (x / 1000 for x in f)))
    # two probe layers' attention: 4 ms / 10 ms / 20 ms with flash attention, 1 / 2 / 3 without
    heads = AttentionCosts(1024, ms(4, 10, 20), ms(1, 2, 3), 20000.0, 10000.0)
    costs = scaled(ms(20, 30, 40), 0.0025, heads, 15.0)  # (a target of 30 layers)
    assert costs.estimated and costs.cells == 1024 and costs.beside == 0
    assert costs.with_s == pytest.approx(ms(80, 180, 340)) and costs.without_s == pytest.approx(ms(35, 60, 85))
    # a prompt's token: the target's own 2.5 ms, plus 15 layers of the heads' 0.05 and 0.1 ms
    assert costs.prompt_with == pytest.approx(1 / (0.0025 + 15 / 20000))
    assert costs.prompt_without == pytest.approx(1 / (0.0025 + 15 / 10000))
    assert costs.off_pays
    assert AttentionCosts.from_dict(json.loads(json.dumps(costs.to_dict()))) == costs  # (kept and read back, estimated)


def test_the_estimate_of_the_demo_target_is_measured_once_and_kept(offline_models, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path))  # (its records only: the models are given by path)
    target = offline_models.smollm2_f32
    assert probes(target) and not probes(offline_models.gemma_q4)  # (Gemma 3 attends in a sliding window)
    assert estimated_costs(offline_models.gemma_q4, 1) is None
    costs = estimated_costs(target, 1)
    assert costs is not None and costs.estimated and costs.cells == 1024
    for timed in (costs.with_s, costs.without_s):
        assert set(timed) == {1, 8, 16} and timed[16] > timed[1] > 0  # (a pass of 16 tokens costs more than one)
    record = flash_attention.RECORDS.read(record_key(target, 1, "costs"))
    assert record is not None and AttentionCosts.from_dict(record["attention"]) == costs and record["seconds"] > 0
    # the rounding check was measured in the same load of the target, and kept
    assert isinstance(flash_attention.RECORDS.read(record_key(target, 1, "rounding"))["without"], float)

    # kept: the next run reads it (measuring again would fail here)
    def measured_again(*args):
        raise AssertionError("measured again")
    with monkeypatch.context() as m:
        m.setattr(flash_attention, "probe", measured_again)
        assert estimated_costs(target, 1) == costs
    # a damaged record is measured again and replaced
    path = flash_attention.RECORDS.path(record_key(target, 1, "costs"))
    damaged = json.loads(path.read_text())
    damaged["attention"]["without_s"] = {"1": 0.03}
    path.write_text(json.dumps(damaged))
    again = estimated_costs(target, 1)
    assert again is not None and again.estimated and set(again.without_s) == {1, 8, 16}
    assert AttentionCosts.from_dict(json.loads(path.read_text())["attention"]) == again


def test_the_first_starts_wait_is_a_line_on_a_terminal_only(offline_models, tmp_path, monkeypatch, capsys):
    """The measurement's seconds are a transient line on a terminal's stderr (gone when it ends)
    and nothing on a pipe, where a run's stderr keeps its own lines only."""
    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path))
    assert estimated_costs(offline_models.smollm2_f32, 1) is not None
    assert capsys.readouterr().err == ""  # (not a terminal)
    monkeypatch.setenv("FORCE_COLOR", "1")  # (Rich: a terminal)
    with ui.waiting("timing something once"):
        with ui.waiting("and something inside it"):  # (a display already live: no error)
            pass
    err = capsys.readouterr().err
    assert "timing something once" in err and err.endswith("\x1b[2K")  # (drawn, then the line erased)


def test_a_target_that_rounds_otherwise_without_it_keeps_flash_attention(offline_models, tmp_path, monkeypatch):
    """The demo's Q4_1 file scores a chain bit for bit as one token a pass with flash attention (on
    this build) and by up to a logit apart without it: even where its passes would pay off without
    it, its runs keep it, so its greedy trees stay plain decoding's. The F32 file rounds alike."""
    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path))
    ms = lambda *f: dict(zip((1, 8, 16), (x / 1000 for x in f)))
    paying = AttentionCosts(1024, ms(37.6, 121.6, 216.6), ms(28.5, 50.8, 71.5), 690.0, 530.0)
    q4, f32 = offline_models.smollm2_q4, offline_models.smollm2_f32
    with engine.Model(f32) as model:
        diffs = rounding(model, 1)
    assert diffs["with"] < 0.1 and diffs["without"] < 0.1  # (tinyBLAS from two tokens, either way)
    assert rounds_alike_without(f32, 1)
    save_record(q4, 1, paying)  # (tune's record: off would pay)
    kept = _plan(RunOptions(target=str(q4), no_spec=True, threads=1, ctx_size=2048, quiet=True))
    diffs = flash_attention.RECORDS.read(record_key(q4, 1, "rounding"))  # (measured by that plan, kept)
    assert diffs is not None
    # (the AVX-512 test host: 0 with it, 0.49 without; the plan follows what this machine measured)
    alike = attention_off_rounds_alike(diffs["with"], diffs["without"])
    assert kept.target_ctx.flash_attn == ("off" if alike else None) and bool(kept.attention_why) == alike
    save_record(f32, 1, paying)
    chosen = _plan(RunOptions(target=str(f32), no_spec=True, threads=1, ctx_size=2048, quiet=True))
    assert chosen.target_ctx.flash_attn == "off" and "`specrun tune` timed" in chosen.attention_why


def test_an_untuned_plan_follows_the_estimate_for_one_request_and_says_so(offline_models, cli):
    # (real plans and a real run; the estimate is this machine's, so either way is right)
    target = offline_models.smollm2_f32
    costs = estimated_costs(target, 1)
    assert costs is not None
    off = costs.off_pays and rounds_alike_without(target, 1)
    opts = RunOptions(target="smollm2-135m-f32", no_spec=True, threads=1, ctx_size=2048, quiet=True)
    alone = _plan(opts)
    assert alone.target_ctx.flash_attn == ("off" if off else None)
    assert ("a probe of this CPU's attention estimated" in alone.attention_why) == off
    # several requests at once keep llama.cpp's: without it a request's rows follow where its cells sit
    assert [_plan(replace(opts, parallel=n)).target_ctx.flash_attn for n in (2, 4)] == [None, None]
    result = cli("plan", "--target", "smollm2-135m-f32", "--no-spec", "--threads", "1", "--ctx-size", "2048", "--json")
    assert result.exit_code == 0, result.output
    why = json.loads(result.stdout)["flash_attn_why"]
    assert (why is not None and "a probe of this CPU's attention estimated" in why) == off
    # told, the flag decides
    told = cli("plan", "--target", "smollm2-135m-f32", "--no-spec", "--threads", "1", "--ctx-size", "2048", "--json",
               "--flash-attn", "on")
    assert told.exit_code == 0 and json.loads(told.stdout)["flash_attn_why"] is None
    # a run writes what the same run told `--flash-attn` as chosen writes
    prompt = "The three primary colours are"
    args = ("generate", "--threads", "1", "--budget", "4", "-n", "16", "--temperature", "0")
    chosen = cli(*args, input=prompt)
    told = cli(*args, "--flash-attn", "off" if off else "auto", input=prompt)
    assert chosen.exit_code == 0 and told.exit_code == 0, chosen.output
    assert chosen.stdout == told.stdout and chosen.stdout.strip()
