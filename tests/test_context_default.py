"""The default context: the model's trained context, lowered to what the memory plan holds.

Planned for a registry model before any file exists (qwen2.5-14b and its draft, the sizes of the
real GGUFs), on made-up machines; the demo pair's default is checked on a real server in
tests/test_server_clients.py.
"""

from __future__ import annotations

from dataclasses import replace

from test_offload import QWEN25_05B_Q4KM, QWEN25_14B_Q4KM

from specrun.engine import DeviceInfo
from specrun.hardware import placement
from specrun.runtime.plan import RunOptions, build_plan

GB = 1 << 30
TRAINED = 32768  # Qwen2.5-14B-Instruct's context_length
SIZES = (replace(QWEN25_14B_Q4KM, n_ctx_train=TRAINED), replace(QWEN25_05B_Q4KM, n_ctx_train=TRAINED))
AUTO = RunOptions(target="qwen2.5-14b", ctx_size=None, lookup=False, quiet=True)


def _plan(opts: RunOptions, gpus: list, ram_gb: float):
    return build_plan(opts, fetch=False, devices=gpus, ram_free_bytes=int(ram_gb * GB), sizes=SIZES)


def test_enough_ram_gives_the_trained_context():
    plan = _plan(AUTO, [], 32)
    assert plan.target_ctx.n_ctx == TRAINED and plan.draft_ctx.n_ctx == TRAINED
    assert plan.ctx_why == "the model's trained context" and plan.placement.ram_fits
    assert plan.to_dict()["context"] == {"n_ctx": TRAINED, "why": plan.ctx_why, "n_ctx_train": TRAINED}


def test_little_ram_lowers_the_context_to_what_fits():
    plan = _plan(AUTO, [], 13)
    n_ctx = plan.target_ctx.n_ctx
    assert 4096 < n_ctx < TRAINED and n_ctx % placement.AUTO_CTX_STEP == 0
    assert plan.placement.ram_fits and "lowered to what memory holds" in plan.ctx_why
    assert f"{TRAINED} tokens would not fit" in plan.ctx_why
    # one step more would not have fitted with the draft model: asked for, the plan drafts without it
    wider = replace(AUTO, ctx_size=n_ctx + placement.AUTO_CTX_STEP)
    assert not _plan(replace(wider, draft=plan.files.draft_name), [], 13).placement.ram_fits
    more = _plan(wider, [], 13)
    assert more.placement.ram_fits and not more.draft_loaded
    assert any(f"the draft model {plan.files.draft_name} does not fit beside" in note for note in more.notes)


def test_the_context_never_costs_gpu_layers():
    """On an 8 GB GPU the 14B model is split: a longer context may only use room that layers
    would not have used (llama.cpp's --fit also shrinks the context before moving layers)."""
    gpu = [DeviceInfo("RTX 4060", "assumed", "gpu", "CUDA", int(7.6 * GB), 8 * GB)]
    auto = _plan(AUTO, gpu, 32)
    floor = _plan(replace(AUTO, ctx_size=placement.MIN_AUTO_CTX), gpu, 32)
    assert placement.MIN_AUTO_CTX <= auto.target_ctx.n_ctx < TRAINED
    assert auto.target_gpu_layers == floor.target_gpu_layers > 0
    assert auto.placement.draft_device == floor.placement.draft_device == 0
    assert auto.placement.gpu_fits
    # the plan says the trade-off: what the trained context would keep on the GPU
    trained = _plan(replace(AUTO, ctx_size=TRAINED), gpu, 32)
    assert trained.target_gpu_layers < auto.target_gpu_layers
    assert (f"{TRAINED} tokens would keep {trained.target_gpu_layers} of {trained.placement.target_n_slots} layer "
            f"slots on the GPU; {auto.target_ctx.n_ctx} keep {auto.target_gpu_layers}") in auto.ctx_why


def test_a_model_that_does_not_say_its_context_gets_the_old_default():
    n_ctx, why = placement.largest_context(QWEN25_05B_Q4KM, None, [], 512, ram_free_bytes=32 * GB)
    assert (n_ctx, why) == (placement.MIN_AUTO_CTX, "the model does not say its trained context")


def test_a_model_trained_for_less_than_the_floor_keeps_its_own():
    small = replace(QWEN25_05B_Q4KM, n_ctx_train=2048)
    assert placement.largest_context(small, None, [], 512, ram_free_bytes=32 * GB)[0] == 2048


def test_gguf_metadata_gives_the_trained_context(offline_models):
    assert placement.model_size(offline_models.smollm2_q4).n_ctx_train == 8192


def test_specrun_plan_says_why(offline_models, cli):
    result = cli("plan")
    assert result.exit_code == 0, result.output
    assert "context  8192 tokens (the model's trained context)" in result.stdout
