"""`specrun bench --report`: one shareable report of this machine and this pair, measured on the
real demo models with the smallest settings (a tiny tree, two tokens per prompt)."""

from __future__ import annotations

import json
from dataclasses import replace

from specrun.commands.bench_report import largest_under, markdown, predicted_speedup
from specrun.engine import system_info
from types import SimpleNamespace

from specrun.engine import DeviceInfo
from specrun.runtime.plan import RunOptions, build_plan
from specrun.tuning import attention
from specrun.tuning.attention import AttentionCosts, attention_here
from specrun.tuning.flash_attention import estimated_costs, rounds_alike_without


def test_bench_report_json_and_markdown(tmp_path, cli):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hi.\n")
    result = cli("bench", "--report", "--json", "--target", "smollm2-135m-q4", "--draft", "smollm2-tiny-random",
                 "--budget", "3", "--max-tokens", "2", "--prompts", str(prompts), "--ctx-size", "512", "--threads", "1",
                 "--flash-attn", "off")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # stdout holds the report alone
    assert report["pair"] == {**report["pair"], "target": "smollm2-135m-q4", "draft": "smollm2-tiny-random"}
    assert report["build"]["backends"] and "llama-cpp-python" in report["build"]["llama"]
    assert report["build"]["cpu_batch_invariant"] is ("LLAMAFILE = 1" not in system_info())
    assert any(d["kind"] == "cpu" for d in report["machine"]["devices"])
    # cost per pass for n = 1, 2, 4 (the largest tree: 3 draft tokens + the root)
    assert sorted(map(int, report["cost"]["target_s"])) == [1, 2, 4]
    assert all(s > 0 for s in report["cost"]["target_s"].values())
    assert {1, 2, 4, 8} <= set(map(int, report["cost"]["draft_s"]))
    assert report["plain"]["tokens_per_s"] > 0 and report["placement"]["threads"] == 1
    assert report["placement"]["target_flash_attn"] == "off"  # as asked, every mode measured so
    assert set(report["calibration"]["tau_by_budget"]) == {"1", "3"}  # trees of 1 and 3 draft tokens
    assert report["tune_choice"]["kind"] in ("plain", "specexec", "sequoia") and report["tune_choice"]["text"]
    modes = [row["mode"] for row in report["workloads"]]
    assert modes == ["plain", "draft tree", "lookup", "hybrid"] and report["default_mode"] == "hybrid"
    assert all(row["identical_output"] for row in report["workloads"])  # greedy: every drafter exact
    text = markdown(report)
    assert "| target |" in text and "| n | 1 | 2 | 4 |" in text and "hybrid (default)" in text
    assert ("| CPU kernels | one for every pass size" in text) is report["build"]["cpu_batch_invariant"]
    assert "| target flash attention | off |" in text
    assert text.count("| prompts |") == 4 and "`specrun tune` would choose" in text
    # The target's passes after half the context with and without flash attention, on this CPU
    attention = report["attention"]
    assert attention["cells"] == 256 and list(attention["with_s"]) == list(attention["without_s"]) == ["1", "8", "16"]
    assert all(s > 0 for key in ("with_s", "without_s") for s in attention[key].values())
    assert all(rate > 0 for rate in attention["prompt_tokens_per_s"].values())
    assert ("--flash-attn off` suits" in attention["advice"]) is attention["off_pays"]
    assert "| without (`--flash-attn off`) |" in text and attention["advice"][1:] in text
    # ...and beside another request's text as long in the same cache (a server's lanes; as many
    # as keep the measuring context within the run's 512 tokens)
    beside = attention["beside"]
    assert beside["requests"] == 1 and list(beside["with_s"]) == list(beside["without_s"]) == ["1", "8", "16"]
    assert all(s > 0 for key in ("with_s", "without_s") for s in beside[key].values())
    assert "| without, beside 1 other request as long |" in text
    assert "beside 1 other request's text as long" in attention["advice"]
    assert ("(beside other requests too)" in attention["advice"]) is (beside["off_pays"] and attention["off_pays"])


def test_flash_attention_advice_follows_the_measured_passes():
    def costs(with_ms, without_ms):
        return AttentionCosts(1024, dict(zip((1, 8, 16), with_ms)), dict(zip((1, 8, 16), without_ms)), 690.0, 530.0)

    # The AVX-512 host (docs/benchmarks.md): trees 2.4-3.0x dearer with it, one token 1.3x
    avx512 = costs((37.6, 121.6, 216.6), (28.5, 50.8, 71.5))
    assert avx512.off_pays and "`--flash-attn off` suits one agent" in avx512.advice()
    assert "1.32x / 2.39x / 3.03x" in avx512.advice() and "prompts read 30% faster with it" in avx512.advice()
    # Trees cheaper without it, but not by ATTENTION_TREE_GAIN; or one token dearer without it: the default
    assert not costs((24.0, 48.0, 80.0), (24.0, 42.0, 70.0)).off_pays
    assert not costs((24.0, 65.8, 109.6), (26.0, 48.5, 74.8)).off_pays
    assert costs((24.0, 65.8, 109.6), (25.0, 48.5, 74.8)).off_pays  # (one token within ATTENTION_ONE_TOKEN_SLACK)
    assert costs((24.0, 48.0, 80.0), (24.0, 42.0, 70.0)).advice().endswith("keep the default")


def test_largest_tree_under_twice_a_one_token_pass():
    assert largest_under({1: 0.010, 2: 0.011, 4: 0.015, 8: 0.019, 16: 0.030, 32: 0.012}, 2.0) == 32
    assert largest_under({1: 0.010, 2: 0.025}, 2.0) == 1
    assert largest_under({}, 2.0) == 0


def test_predicted_speedup_combines_a_cost_curve_with_an_acceptance_curve():
    flat = {"1": 0.10, "2": 0.10, "4": 0.11, "8": 0.12, "16": 0.20}  # offloaded: 8 tokens cost 1.2x one
    tau = {"1": 0.9, "3": 1.8, "7": 2.6, "15": 3.0}
    assert predicted_speedup(flat, tau) == (7, 0.10 * 3.6 / 0.12)
    assert predicted_speedup({"1": 0.1, "2": 0.3}, {"1": 0.5}) == (0, 1.0)  # no tree pays: plain


def test_attention_is_timed_only_where_the_target_attends_on_this_cpu_over_an_f16_cache(offline_models):
    # (the plans are real, nothing is loaded: each case is told apart before a context opens)
    opts = RunOptions(threads=1, ctx_size=512, quiet=True)
    gpu = [DeviceInfo("RTX 4060", "assumed", "gpu", "CUDA", 7 * 2**30, 8 * 2**30)]
    on_gpu = build_plan(opts, None, devices=gpu, ram_free_bytes=16 * 2**30)
    assert on_gpu.target_gpu_layers > 0 and attention_here(SimpleNamespace(plan=on_gpu), opts) is None
    quantized = replace(opts, kv_type="q8_0")
    plan = build_plan(quantized, None, devices=[], ram_free_bytes=16 * 2**30)
    assert attention_here(SimpleNamespace(plan=plan), quantized) is None  # (a q8_0 cache needs it on)
    over_rpc = replace(opts, rpc=("192.168.1.20:50052",))
    assert attention_here(SimpleNamespace(plan=build_plan(opts, None, devices=[], ram_free_bytes=16 * 2**30)), over_rpc) is None


def _record(offline_models, with_ms, without_ms, threads=1, beside=None):
    """tune's flash-attention record for the demo target (what attention_here would have timed);
    `beside`: the passes with and without it beside 3 other requests' texts."""
    def ms(figures):
        return dict(zip((1, 8, 16), (f / 1000 for f in figures)))
    costs = AttentionCosts(1024, ms(with_ms), ms(without_ms), 690.0, 530.0,
                           *((3, ms(beside[0]), ms(beside[1])) if beside else ()))
    assert AttentionCosts.from_dict(costs.to_dict()) == costs
    return attention.save_record(offline_models.smollm2_f32, threads, costs)


def test_tunes_record_decides_flash_attention_for_one_request_on_this_cpu(offline_models, cli, caplog):
    # (real plans, with llama.cpp's memory simulation of the contexts; nothing is loaded)
    opts = RunOptions(target="smollm2-135m-f32", no_spec=True, threads=1, ctx_size=2048, quiet=True)

    def plan(o=opts, devices=()):
        return build_plan(o, None, devices=list(devices), ram_free_bytes=16 * 2**30)

    # No record: the estimate (tuning.flash_attention, measured once a machine and kept), where the
    # demo target rounds alike without it (its passes of several tokens: tinyBLAS either way)
    probe = estimated_costs(offline_models.smollm2_f32, 1)
    assert probe is not None and probe.estimated
    alike = rounds_alike_without(offline_models.smollm2_f32, 1)  # (this machine's: on the AVX-512 host, yes)

    def untuned(costs=probe):
        return "off" if costs.off_pays and alike else None

    untold = plan()
    assert untold.target_ctx.flash_attn == untuned() and bool(untold.attention_why) == (untuned() == "off")
    assert not untold.attention_why or "a probe of this CPU's attention estimated" in untold.attention_why
    _record(offline_models, (37.6, 121.6, 216.6), (28.5, 50.8, 71.5))  # the AVX-512 host's figures
    chosen = plan()
    assert chosen.target_ctx.flash_attn == "off"
    assert "16-token passes after 1,024 cached tokens 3.0x faster without it" in chosen.attention_why
    assert chosen.to_dict()["contexts"]["target"]["flash_attn"] == "off"
    assert chosen.to_dict()["flash_attn_why"] == chosen.attention_why
    assert untold.to_dict()["flash_attn_why"] == (untold.attention_why or None)
    # llama.cpp's simulation opened the context as the run will: as `--flash-attn off` plans it
    told = plan(replace(opts, flash_attn="off"))
    assert chosen.placement.measured and chosen.placement == told.placement
    assert (told.placement == untold.placement) == (untuned() == "off")
    assert chosen.target_ctx == told.target_ctx and not told.attention_why
    # Told, or where the record does not speak for the run, it is not used
    assert plan(replace(opts, flash_attn="on")).target_ctx.flash_attn == "on"
    assert plan(replace(opts, parallel=2)).target_ctx.flash_attn is None  # beside other requests: llama.cpp's
    assert plan(replace(opts, kv_type="q8_0")).target_ctx.flash_attn is None  # (on: a quantized cache needs it)
    gpu = [DeviceInfo("RTX 4060", "assumed", "gpu", "CUDA", 7 * 2**30, 8 * 2**30)]
    assert plan(devices=gpu).target_ctx.flash_attn is None
    # (a record per thread count: none for 2, so the estimate for 2 threads)
    assert plan(replace(opts, threads=2)).target_ctx.flash_attn == untuned(costs=estimated_costs(offline_models.smollm2_f32, 2))
    # Timed beside 3 other requests' texts too, paying there as well (the AVX-512 host): several
    # requests at once still keep llama.cpp's (without it a request's rows follow where its cells
    # sit among the others'), a server's default lanes included
    _record(offline_models, (37.6, 121.6, 216.6), (28.5, 50.8, 71.5), beside=((53.9, 147.2, 264.2), (43.0, 91.0, 140.4)))
    assert [plan(replace(opts, parallel=n)).target_ctx.flash_attn for n in (1, 2, 4, 5)] == ["off", None, None, None]
    several = plan(replace(opts, parallel=None))  # (serve's default: as many as fit)
    assert several.target_ctx.flash_attn == ("off" if several.target_ctx.parallel == 1 else None)
    # A record of figures that do not pay (one token dearer without it: the 2026-11-27 host): the default
    _record(offline_models, (24.0, 65.8, 109.6), (26.0, 48.5, 74.8))
    assert plan().target_ctx.flash_attn is None
    # A damaged record: one warning naming it, and as without a record
    path = _record(offline_models, (37.6, 121.6, 216.6), (28.5, 50.8, 71.5))
    record = json.loads(path.read_text())
    record["attention"]["without_s"] = {"1": 0.0285}
    path.write_text(json.dumps(record))
    with caplog.at_level("WARNING", logger="specrun"):  # (as without one: the probe's estimate)
        assert plan().target_ctx.flash_attn == untuned()
        several = plan(replace(opts, parallel=None))  # (a plan of several builds)
        assert several.target_ctx.flash_attn == (untuned() if several.target_ctx.parallel == 1 else None)
    warned = [r for r in caplog.records if "ignoring the flash attention record" in r.getMessage()]
    assert len(warned) == 1 and str(path) in warned[0].getMessage()  # once a process, as read_json's own
    path.write_text("{not json")
    assert plan().target_ctx.flash_attn == untuned()
    # `specrun plan` says where it came from
    _record(offline_models, (37.6, 121.6, 216.6), (28.5, 50.8, 71.5))
    result = cli("plan", "--target", "smollm2-135m-f32", "--no-spec", "--threads", "1", "--ctx-size", "2048")
    assert result.exit_code == 0, result.output
    assert "target flash attention off: `specrun tune` timed" in result.output


def test_a_run_opens_the_target_as_the_record_says(offline_models, cli):
    """generate with tune's record: the context opens without flash attention, says so on stderr,
    and writes what `--flash-attn off` writes (plain decoding and speculation alike)."""
    prompt = "The three primary colours are"
    untuned = cli("generate", "--threads", "1", "-n", "8", input=prompt)  # (the first untuned run's tip says tune times it)
    assert untuned.exit_code == 0 and "and whether its target's attention runs faster without flash attention" in untuned.stderr
    _record(offline_models, (37.6, 121.6, 216.6), (28.5, 50.8, 71.5))
    args = ("generate", "--threads", "1", "--budget", "4", "-n", "24", "--temperature", "0", "--verbose")
    recorded = cli(*args, input=prompt)
    assert recorded.exit_code == 0, recorded.output
    assert "flash attention off: `specrun tune` timed this target's 16-token passes" in recorded.stderr
    told = cli(*args, "--flash-attn", "off", input=prompt)
    plain = cli(*args, "--no-spec", input=prompt)
    assert told.exit_code == 0 and plain.exit_code == 0
    assert recorded.stdout == told.stdout == plain.stdout and recorded.stdout.strip()
    assert "flash attention off: `specrun tune`" in plain.stderr  # (the target alone: the same record)


def test_a_servers_lanes_keep_flash_attention_and_one_lane_says_where_its_came_from(offline_models):
    """With a record that pays beside 3 other requests' texts too, a server of 4 lanes keeps
    llama.cpp's flash attention (without it a lane's rows would follow where its cells sit among
    the others'); a server of one lane opens without it, and its startup line says a measurement
    chose it, not --flash-attn."""
    from specrun.runtime.runtime import Runtime
    from specrun.server.worker import describe

    _record(offline_models, (37.6, 121.6, 216.6), (28.5, 50.8, 71.5), beside=((53.9, 147.2, 264.2), (43.0, 91.0, 140.4)))
    opts = RunOptions(target="smollm2-135m-f32", no_spec=True, threads=1, ctx_size=1024, parallel=4, quiet=True)
    with Runtime(opts) as rt:
        assert rt.plan.target_ctx.flash_attn is None and len(rt.decoders) == 4 and "flash attention" not in describe(rt)
    with Runtime(replace(opts, parallel=1)) as rt:
        assert rt.plan.target_ctx.flash_attn == "off" and rt.target_ctx.flash_attn == "off"
        assert "flash attention off (as timed on this CPU)" in describe(rt)
    with Runtime(replace(opts, flash_attn="off")) as told:
        assert "flash attention off (--flash-attn)" in describe(told)
