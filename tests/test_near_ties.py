"""Greedy tokens chosen at a near-tie are reported: the decoders count them, `generate --verbose`
names them on stderr, the server logs them (docs/exactness.md#near-ties-reported).

The tiny random-weight model with SmolLM2's tokenizer has many near-ties as a target: its logits
are nearly flat. The F32 demo target answers the capital question without one.
"""

from __future__ import annotations

import ast
import json
import re

import httpx
import pytest

from specrun import engine
import numpy as np

from specrun.core.sampling import (NEAR_TIE_NATS, NEAR_TIE_NATS_OFFLOADED, SamplingParams, make_rng, near_tie,
                                   near_tie_nats)
from specrun.core.tree_shapes import TreeShape
from specrun.decoding.drafters.best_first import TreeGrower
from specrun.decoding.plain import PlainDecoder
from specrun.decoding import speculative
from specrun.decoding.speculative import SpeculativeDecoder
from test_server import running_server

# A raw prompt whose greedy continuation by the tiny random model meets near-ties.
TINY_PROMPT = "The history of the printing press begins"
N_TOKENS = 48
# Where the target's two best tokens are this far from the threshold, a one-token pass and a tree
# pass agree on which side of it they lie (the cross-shape noise, docs/exactness.md, with margin).
SHAPE_NOISE = 0.01
TREE = TreeShape(budget=8, depth=4, width=2, top_k=2)
# The F32 demo target's answer to this question has no near-tie (its closest gap is far above).
QUESTION = "What is the capital of France?"
PLAIN_F32 = ["--target", "smollm2-135m-f32", "--no-spec", "--threads", "1", "--ctx-size", "512"]
TIE_LINE = re.compile(r"near-tie at token (\d+): (.+) over (.+) by ([0-9.]+) nats; "
                      r"a pass of another shape may choose the other$")


@pytest.fixture(scope="module")
def tiny(offline_models, load_model):
    return load_model(offline_models.smollm2_random)


@pytest.fixture(scope="module")
def contexts():
    owned: list[engine.Context] = []

    def make(model, n_batch=64, n_seq_max=engine.MAX_SEQ):
        owned.append(engine.Context(model, n_ctx=512, n_batch=n_batch, n_seq_max=n_seq_max))
        return owned[-1]

    yield make
    for ctx in owned:
        ctx.close()


def _decode(decoder, prompt, params, n=N_TOKENS):
    """Return the generated tokens, the steps, and the generation's near-ties."""
    steps = list(decoder.steps(prompt, params, n, make_rng(0)))
    return [t for s in steps for t in s.tokens], steps, decoder.stats.near_ties


def _top_two(step_logprobs):
    """Return each token's two best alternatives as {id: log-prob}, from plain's --logprobs 2."""
    return [dict(lp.top) for lp in step_logprobs]


@pytest.fixture(scope="module")
def plain_reference(tiny, contexts):
    """Plain greedy decoding of TINY_PROMPT by the tiny model: tokens, each row's two best
    log-probs (from the one-token pass the token was chosen from), and the reported near-ties."""
    plain = PlainDecoder(tiny, contexts(tiny, n_seq_max=1))
    prompt = tiny.tokenize(TINY_PROMPT)
    tokens, steps, ties = _decode(plain, prompt, SamplingParams(logprobs=2))
    tops = _top_two(lp for s in steps for lp in s.logprobs)
    return prompt, tokens, tops, ties, plain


def test_plain_greedy_decoding_reports_each_near_tie_with_its_gap(plain_reference):
    prompt, tokens, tops, ties, _ = plain_reference
    expected = []
    for i, top in enumerate(tops):
        (best, lp_best), (second, lp_second) = top.items()
        assert best == tokens[i]  # greedy: the best token
        if lp_best - lp_second < NEAR_TIE_NATS:
            expected.append((i, best, second, lp_best - lp_second))
    assert expected, "the tiny model should meet near-ties on this prompt"
    assert [(t.at, t.token, t.runner_up) for t in ties] == [e[:3] for e in expected]
    for tie, (*_, gap) in zip(ties, expected):
        assert tie.gap == pytest.approx(gap, abs=1e-5)
        assert 0 <= tie.gap < NEAR_TIE_NATS


def test_speculative_greedy_decoding_reports_the_near_ties_of_tree_passes(plain_reference, tiny, contexts):
    """The tiny model drafts for itself, so most tokens come from tree passes; where the tree pass
    and plain's one-token pass choose differently, a near-tie was reported there."""
    prompt, plain_tokens, tops, _, _ = plain_reference
    spec = SpeculativeDecoder(tiny, contexts(tiny), TreeGrower(tiny, contexts(tiny), TREE), TREE)
    tokens, steps, ties = _decode(spec, prompt, SamplingParams())
    assert sum(s.accepted for s in steps) > N_TOKENS // 4, "the trees should have been accepted"
    at = {tie.at: tie for tie in ties}
    assert len(at) == len(ties) == spec.stats.as_dict()["near_ties"]
    n_both = min(len(tokens), len(plain_tokens))
    same = next((i for i in range(n_both) if tokens[i] != plain_tokens[i]), n_both)
    if same < n_both:
        assert same in at, f"the answer parted from plain decoding's at token {same} without a near-tie"
    for i in range(min(same + 1, n_both)):
        top = tops[i]
        plain_gap = list(top.values())[0] - list(top.values())[1]
        if i in at:
            tie = at[i]
            assert tie.token == tokens[i] and {tie.token, tie.runner_up} == set(top)
            # the same two tokens, and the gap plain decoding's pass measured, up to the shape's noise
            assert tie.gap == pytest.approx(top[tie.token] - top[tie.runner_up], abs=SHAPE_NOISE)
            assert 0 <= tie.gap < NEAR_TIE_NATS
        else:
            assert plain_gap > NEAR_TIE_NATS - SHAPE_NOISE, f"token {i}: a near-tie went unreported"
    from_trees = [tie for s in steps if s.tree_nodes for tie in s.near_ties]
    assert from_trees, "no near-tie was met in a tree pass"


def test_a_target_on_a_gpu_or_worker_judges_near_ties_wider():
    """CUDA's kernels part further between pass sizes than the CPU's (choices flipped at gaps up
    to 0.059 on an H100): where the target computes there, a wider gap is still a near-tie."""
    assert near_tie_nats(False) == NEAR_TIE_NATS < near_tie_nats(True) == NEAR_TIE_NATS_OFFLOADED
    row = np.array([0.0, 3.0, 3.0 - 0.05, 1.0], dtype=np.float32)
    assert near_tie(row, 1) is None
    tie = near_tie(row, 1, nats=near_tie_nats(True))
    assert (tie.token, tie.runner_up) == (1, 2) and tie.gap == pytest.approx(0.05, abs=1e-6)


def test_an_offloaded_target_s_decoders_report_by_the_wider_threshold(plain_reference, tiny, contexts, monkeypatch):
    """The decoders read where their target computes (engine.Model.offloaded, set here as a GPU
    load would set it: this machine has none): plain and tree passes then report every choice
    whose runner-up trailed by less than NEAR_TIE_NATS_OFFLOADED."""
    prompt, plain_tokens, tops, narrow, _ = plain_reference
    assert tiny.offloaded is False
    monkeypatch.setattr(tiny, "offloaded", True)
    gaps = [list(top.values())[0] - list(top.values())[1] for top in tops]
    _, _, wide = _decode(PlainDecoder(tiny, contexts(tiny, n_seq_max=1)), prompt, SamplingParams())
    assert [t.at for t in wide] == [i for i, gap in enumerate(gaps) if gap < NEAR_TIE_NATS_OFFLOADED]
    assert len(wide) > len(narrow), "the tiny model should meet gaps between the two thresholds"
    spec = SpeculativeDecoder(tiny, contexts(tiny), TreeGrower(tiny, contexts(tiny), TREE), TREE)
    tokens, steps, ties = _decode(spec, prompt, SamplingParams())
    same = next((i for i in range(len(tokens)) if tokens[i] != plain_tokens[i]), len(tokens))
    reported = {t.at for t in ties}
    for i in range(same):
        if gaps[i] < NEAR_TIE_NATS_OFFLOADED - SHAPE_NOISE:
            assert i in reported, f"token {i}: a gap of {gaps[i]:.4f} went unreported"
        elif gaps[i] > NEAR_TIE_NATS_OFFLOADED + SHAPE_NOISE:
            assert i not in reported
    assert any(NEAR_TIE_NATS <= t.gap < NEAR_TIE_NATS_OFFLOADED for s in steps if s.tree_nodes for t in s.near_ties)


def test_a_model_is_offloaded_where_its_layers_reach_a_gpu_or_a_worker(offline_models, monkeypatch):
    """Model.offloaded: layers asked for a GPU that is there, or for RPC workers' devices across
    hosts. This machine has no GPU: every layer stays here, whatever n_gpu_layers asks; a GPU and
    a worker are then passed in as llama.cpp would list them (the flag only; the load stays here)."""
    from specrun.engine import model as model_module

    def offloaded(**kwargs) -> bool:
        m = engine.Model(offline_models.smollm2_random, **kwargs)
        try:
            return m.offloaded
        finally:
            m.close()

    assert model_module.local_gpus() == [] and offloaded(n_gpu_layers=99) is False  # no GPU here
    monkeypatch.setattr(model_module, "local_gpus", lambda: [0x1])  # one GPU, as ggml would list its device
    assert offloaded(n_gpu_layers=99) is True
    assert offloaded(n_gpu_layers=0) is False
    monkeypatch.setattr(model_module, "local_gpus", lambda: [])
    monkeypatch.setattr(model_module, "remote_hosts", lambda: ["10.0.0.2:50052"])
    assert offloaded(n_gpu_layers=99) is False  # a worker is listed, but this model is not spread over hosts


def test_sampled_tokens_are_not_judged(plain_reference):
    """A sampled token is no greedy choice: nothing is reported, near-ties or not."""
    prompt, _, _, _, plain = plain_reference
    _, _, ties = _decode(plain, prompt, SamplingParams(temperature=1.0, seed=3))
    assert ties == [] and plain.stats.as_dict()["near_ties"] == 0


@pytest.mark.parametrize("kind", ["plain", "speculative"])
def test_a_near_tie_is_judged_on_the_row_after_logit_bias(kind, offline_models, load_model, contexts):
    """logit_bias brings the F32 target's runner-up within 0.005 nats of its best token, or 0.005
    past it: the token chosen from the biased row is reported at that gap, over the other."""
    target = load_model(offline_models.smollm2_f32)
    if kind == "plain":
        decoder = PlainDecoder(target, contexts(target, n_seq_max=1))
    else:
        decoder = SpeculativeDecoder(target, contexts(target), TreeGrower(target, contexts(target), TREE), TREE)
    prompt = target.tokenize("The capital of France is")
    _, steps, ties = _decode(decoder, prompt, SamplingParams(logprobs=2), n=1)
    assert ties == []
    (best, lp_best), (second, lp_second) = steps[0].logprobs[0].top
    gap = lp_best - lp_second
    assert gap > 10 * NEAR_TIE_NATS
    for shift, chosen, runner_up in ((-0.005, best, second), (0.005, second, best)):
        params = SamplingParams(logit_bias=((second, gap + shift),))
        tokens, _, ties = _decode(decoder, prompt, params, n=1)
        assert tokens == [chosen]
        assert [(t.at, t.token, t.runner_up) for t in ties] == [(0, chosen, runner_up)]
        assert ties[0].gap == pytest.approx(0.005, abs=1e-4)


def test_generate_verbose_names_each_near_tie_on_stderr_only(cli, offline_models, tiny):
    tiny_args = ["--target", str(offline_models.smollm2_random), "--no-spec", "--raw", "--threads", "1",
                 "--ctx-size", "512", "-n", str(N_TOKENS)]
    result = cli("generate", TINY_PROMPT, "--json", "--verbose", *tiny_args)

    assert result.exit_code == 0, result.output
    assert "near-tie" not in result.stdout
    out = json.loads(result.stdout)
    lines = [m for m in (TIE_LINE.search(line) for line in result.stderr.splitlines()) if m]
    assert len(lines) == out["stats"]["near_ties"] > 0, result.stderr
    for m in lines:
        index, chosen, gap = int(m[1]), ast.literal_eval(m[2]), float(m[4])
        assert chosen == tiny.token_to_piece(out["token_ids"][index], special=True).decode("utf-8", "replace")
        assert isinstance(ast.literal_eval(m[3]), str)
        assert 0 <= gap < NEAR_TIE_NATS

    quiet = cli("generate", TINY_PROMPT, "--stats", *tiny_args)
    assert quiet.exit_code == 0, quiet.output
    assert "near-tie" not in quiet.stdout and not TIE_LINE.search(quiet.stderr)
    assert f"{out['stats']['near_ties']} near-tie" in quiet.stderr  # the count in the --stats line


def test_an_answer_without_near_ties_reports_none(cli):
    result = cli("generate", QUESTION, "-n", "12", "--json", "--verbose", *PLAIN_F32)

    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["stats"]["near_ties"] == 0
    assert "near-tie" not in result.stderr
    stats = cli("generate", QUESTION, "-n", "12", "--stats", *PLAIN_F32)
    assert stats.exit_code == 0 and "tok/s" in stats.stderr and "near-tie" not in stats.stderr


def test_the_server_logs_a_request_s_near_ties(offline_models, tmp_path):
    body = {"model": "tiny", "prompt": TINY_PROMPT, "max_tokens": N_TOKENS, "temperature": 0}
    with running_server(tmp_path / "home", "--target", str(offline_models.smollm2_random), "--no-spec") as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            tied = http.post("/v1/completions", json=body).json()
            sampled = http.post("/v1/completions", json={**body, "temperature": 1.0, "seed": 3}).json()
    # (the server has stopped: its stderr is all there)
    lines = [line for line in srv.stderr_lines if "near-tie" in line]
    assert len(lines) == 1, srv.stderr
    match = re.fullmatch(rf"{tied['id']}: (\d+) near-ties?, the closest by ([0-9.]+) nats: .*", lines[0])
    assert match and int(match[1]) > 0 and 0 <= float(match[2]) < NEAR_TIE_NATS, lines[0]
    assert any(line.startswith(f"{sampled['id']}: prompt") for line in srv.stderr_lines), srv.stderr


# The tiny random draft beside the F32 demo target: near-ties are where trees may part from plain.
SPEC_F32 = ["--target", "smollm2-135m-f32", "--draft", "smollm2-135m-q4", "--threads", "1", "--ctx-size", "512"]
STORY = "Tell me a short story about a lighthouse keeper."


def test_reproducible_is_plain_decoding_bit_for_bit(cli):
    plain = cli("generate", "--json", "-n", "40", *PLAIN_F32, STORY)
    pinned = cli("generate", "--json", "-n", "40", "--reproducible", *SPEC_F32, STORY)
    assert plain.exit_code == 0 and pinned.exit_code == 0, pinned.output
    ours, theirs = json.loads(pinned.stdout), json.loads(plain.stdout)
    assert ours["token_ids"] == theirs["token_ids"]
    if engine.runs_batch_invariant():  # chains verify as one-token passes do: they still speculate
        assert ours["drafter"] == "hybrid"
        assert ours["stats"]["max_tree_nodes"] > 0 and ours["stats"]["n_passes"] < theirs["stats"]["n_passes"]
    else:  # one token a pass, so the draft model is not even loaded
        assert ours["drafter"] == "none" and "speculation" not in pinned.stderr
        assert ours["stats"]["max_tree_nodes"] == 0 and ours["stats"]["n_passes"] == theirs["stats"]["n_passes"]


@pytest.mark.parametrize("plainly", ["--reproducible", "--no-spec"])
def test_a_misspelt_draft_is_an_error_where_a_run_loads_none(cli, plainly):
    # Where nothing would draft the draft is not loaded, yet a name that names no model is still
    # the user's mistake to hear about (one line, exit 2), not something silently ignored.
    args = [a if a != "smollm2-135m-q4" else "smollm2-135m-q44" for a in SPEC_F32]
    result = cli("generate", "-n", "4", plainly, *args, STORY)
    assert result.exit_code != 0 and result.stdout == ""
    assert "unknown model 'smollm2-135m-q44'" in result.stderr and "Traceback" not in result.stderr


def test_a_reproducible_jsonl_line_decodes_alone_beside_lines_that_speculate(cli):
    lines = [json.dumps({"prompt": STORY, "reproducible": True, "id": "pinned"}),
             json.dumps({"prompt": "Write a list of five fruits.", "id": "free"}),
             json.dumps({"prompt": STORY, "reproducible": "yes"})]
    result = cli("generate", "--jsonl", "-n", "32", "--parallel", "2", *SPEC_F32, input="\n".join(lines) + "\n")
    plain = cli("generate", "--json", "-n", "32", *PLAIN_F32, STORY)
    assert plain.exit_code == 0
    pinned, free, bad = [json.loads(line) for line in result.stdout.splitlines()]
    assert pinned["id"] == "pinned" and pinned["token_ids"] == json.loads(plain.stdout)["token_ids"]
    assert pinned["stats"]["shared_passes"] == 0
    assert (pinned["stats"]["max_tree_nodes"] > 0) is engine.runs_batch_invariant()
    assert free["id"] == "free" and "error" not in free
    assert bad["field"] == "reproducible" and bad["line"] == 3


def test_where_passes_are_batch_invariant_a_greedy_tree_keeps_plain_decodings_rows(
        plain_reference, tiny, contexts, monkeypatch):
    # Where the target's passes are measured batch invariant (kv.chains_exact: a build without
    # llamafile, F32 weights) a tree's first path, laid first in the batch and so in plain
    # decoding's cells, is scored with plain decoding's rows bit for bit, and a greedy step keeps
    # only what those rows chose. So greedy trees decode as plain decoding does there, and a
    # --reproducible request keeps verifying trees, each in a pass of its own.
    invariant = engine.runs_batch_invariant()
    monkeypatch.setattr(speculative, "chains_exact", lambda ctx: True)
    prompt, tokens, tops, _, _ = plain_reference
    for params in (SamplingParams(logprobs=2), SamplingParams(logprobs=2, pinned=True)):
        decoder = SpeculativeDecoder(tiny, contexts(tiny), TreeGrower(tiny, contexts(tiny), TREE), TREE)
        decoder.path_alone = False  # (the whole tree in the pass, its first path read: the tree passes under test)
        ours, steps, _ = _decode(decoder, prompt, params)
        drafted = [s for s in steps if s.tree_nodes]
        assert drafted and any(s.tree_leaves > 1 for s in drafted), "trees, not only chains"
        assert all(s.shared == 1 for s in steps) and sum(s.accepted for s in steps) > 0
        if invariant:  # on this build, really: plain decoding's tokens and log-probs
            assert ours == tokens and _top_two(lp for s in steps for lp in s.logprobs) == tops
    # A seeded sample stays plain: its draws would follow chains sized by the clock.
    _, steps, _ = _decode(decoder, prompt, SamplingParams(temperature=1.0, seed=3))
    assert not any(s.tree_nodes for s in steps[1:])
