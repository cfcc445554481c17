"""MTP drafting (`--draft mtp`): a target's own MTP layers propose chains, the target verifies them.

The model is a tiny random-weight qwen35 (Gated DeltaNet hybrid: chains verified with a rollback
every step) with one MTP block, written with the real Qwen3.5 tokenizer (tests/tiny_archs.py).
Its MTP block is random too, so its drafts are almost always rejected: every step rolls the
target's recurrent state back and catches the MTP cache up, the strictest exactness check there is.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import numpy as np
import pytest
from test_speculative import GREEDY, chat_prompt, check_divergences, compare, plain_reference
from tiny_archs import tiny_arch_model

from specrun import engine
from specrun.core.sampling import SamplingParams, make_rng, target_probs
from specrun.core.tree_shapes import TreeShape
from specrun.decoding.batching import Lane, PassGate
from specrun.decoding.drafters.mtp import MtpDrafter
from specrun.decoding.pay.together import Together
from specrun.decoding.plain import PlainDecoder
from specrun.decoding.speculative import SpeculativeDecoder
from specrun.decoding.stream import token_ids
from specrun.errors import EngineError
from specrun.runtime.plan import RunOptions, build_plan

N_TOKENS = 16


@pytest.fixture(scope="module")
def mtp_path(offline_models):
    from conftest import MODEL_CACHE

    return tiny_arch_model(MODEL_CACHE, "qwen35", mtp=True)


@pytest.fixture(scope="module")
def mtp_model(mtp_path, load_model):
    return load_model(mtp_path, load_mtp=True)


@pytest.fixture(scope="module")
def contexts():
    """Make target contexts (with recurrent snapshots) and MTP contexts; close them all after."""
    owned = []

    def make(model, mtp=False, **kwargs):
        ctx = engine.MtpContext(model, **kwargs) if mtp else engine.Context(model, **kwargs)
        owned.append(ctx)
        return ctx

    yield make
    for ctx in reversed(owned):
        ctx.close()


@pytest.fixture(scope="module")
def plain(mtp_model, contexts):
    return PlainDecoder(mtp_model, contexts(mtp_model, n_ctx=512, n_batch=64, n_seq_max=1))


@pytest.fixture(scope="module")
def prompts(mtp_model):
    return [chat_prompt(mtp_model, text) for text in ("List the planets.", "Write a haiku about the sea.")]


@pytest.fixture(scope="module")
def references(plain, prompts):
    return [plain_reference(plain, p, N_TOKENS) for p in prompts]


def mtp_decoder(model, contexts, chain: int, mtp_batch: int = 512) -> SpeculativeDecoder:
    target_ctx = contexts(model, n_ctx=512, n_batch=64, n_seq_max=1, n_rs_seq=chain)
    engine.enable_target_rows(target_ctx)
    mtp_ctx = contexts(model, mtp=True, n_ctx=512, n_batch=mtp_batch)
    return SpeculativeDecoder(model, target_ctx, MtpDrafter(mtp_ctx, chain), TreeShape.chain(chain))


def test_model_carries_one_mtp_layer(mtp_path, mtp_model):
    assert engine.n_layer_nextn(mtp_model) == 1
    assert engine.gguf_has_mtp_layers(mtp_path)
    assert mtp_model.n_layer == 4  # the trunk; the MTP block is counted apart


@pytest.mark.parametrize("chain", [1, 3])
def test_greedy_output_equals_plain_decoding(chain, mtp_model, contexts, prompts, references):
    """The second prompt reuses nothing of the first (a recurrent state restarts) while the MTP
    cache finds its text replaced; a small MTP batch splits the prompt's catch-up."""
    spec = mtp_decoder(mtp_model, contexts, chain, mtp_batch=8)
    divergences, drafted = [], 0
    for k, (prompt, ref) in enumerate(zip(prompts if chain > 1 else prompts[:1], references)):
        out = token_ids(spec, prompt, GREEDY, N_TOKENS)
        drafted += sum(s.tree_nodes for s in spec.stats.steps)
        divergences.append(compare(ref, out, N_TOKENS, f"chain {chain}, prompt {k}"))
    check_divergences([d for d in divergences if d], len(divergences), f"MTP chain {chain}")
    assert drafted >= N_TOKENS // 2, "the MTP head should have proposed drafts at most steps"


def test_a_continued_conversation_reuses_the_mtp_cache(mtp_model, contexts, prompts, references, plain):
    """A second request that extends the first (a chat's next turn): the target keeps its prefix,
    the MTP cache keeps what it fed, and the output is still plain decoding's."""
    spec = mtp_decoder(mtp_model, contexts, 3)
    first = token_ids(spec, prompts[0], GREEDY, N_TOKENS)
    longer = prompts[0] + first + prompts[1][-6:]
    fed_before = len(spec.drafter.fed)
    out = token_ids(spec, longer, GREEDY, 8)
    assert fed_before > len(prompts[0])
    assert spec.stats.n_prefilled < len(longer), "the target should have reused its cached prefix"
    assert out == token_ids(plain, longer, GREEDY, 8)


def test_seeded_sampling_emits_plain_tokens(mtp_model, contexts, plain, prompts):
    """T > 0: with one seed, MTP speculation and plain sampling emit the same tokens (the walk draws
    one uniform per emitted token); a difference only where the draw sits at an interval's edge."""
    spec = mtp_decoder(mtp_model, contexts, 3)
    n, compared, runs = 8, 0, 0
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=40, top_p=0.9)):
        for seed in (params.top_k,):  # one seed per setting
            tokens, cdfs = [], []
            for step in plain.steps(prompts[0], params, n, make_rng(seed)):
                cdfs.append(np.cumsum(target_probs(plain.ctx.logits_row(-1), params)))
                tokens.extend(step.tokens)
            out = token_ids(spec, prompts[0], params, n, seed=seed)
            runs += 1
            i = next((i for i, (a, b) in enumerate(zip(tokens, out)) if a != b), None)
            if i is None:
                assert out == tokens
                compared += len(out)
                continue
            compared += i
            u = make_rng(seed).random(i + 1)[i]
            lo, hi = (cdfs[i][out[i] - 1] if out[i] else 0.0), cdfs[i][out[i]]
            assert max(lo - u, u - hi, 0.0) < 0.02, f"seed {seed}, {params}: token {i} is {out[i]}, plain drew {tokens[i]}"
    assert compared >= runs * n // 2


class _Recorded(MtpDrafter):
    """An MTP drafter that keeps each proposal by the length of the text it drafted below."""

    def __init__(self, *args):
        super().__init__(*args)
        self.proposed: dict[int, list[int]] = {}

    def propose(self, committed, root, budget, depth):
        proposal = super().propose(committed, root, budget, depth)
        if proposal is not None:
            self.proposed[len(committed)] = proposal.tree.tokens[1:].tolist()
        return proposal


def test_two_requests_draft_with_mtp_in_shared_passes_as_each_alone(mtp_model, contexts, prompts, references):
    """Two requests in lanes of one target context and of one MTP context (a sequence each),
    drafting beside each other: each greedy answer is plain decoding's, their verify passes are
    shared, their MTP passes too (the MTP context's gate in the target gate's room, as serve
    --parallel opens them), and each request's MTP drafts are the ones it proposes alone, which
    holds only if it reads its own rows of a shared pass (the target's and the MTP block's sit at
    its offset in each batch)."""
    chain = 3

    def drafters(mtp_ctx, n, gate=None):
        return [_Recorded(Lane(mtp_ctx, range(i, i + 1), gate=gate), chain) for i in range(n)]

    alone = []
    target_ctx = contexts(mtp_model, n_ctx=512, n_batch=64, n_seq_max=1, n_rs_seq=chain)
    engine.enable_target_rows(target_ctx)
    mtp_ctx = contexts(mtp_model, mtp=True, n_ctx=512)
    divergences = []
    for k, (prompt, ref) in enumerate(zip(prompts, references)):
        drafter = drafters(mtp_ctx, 1)[0]
        target_ctx.clear()
        out = token_ids(SpeculativeDecoder(mtp_model, target_ctx, drafter, TreeShape.chain(chain)), prompt,
                        GREEDY, N_TOKENS)
        divergences.append(compare(ref, out, N_TOKENS, f"alone, prompt {k}"))
        alone.append(drafter.proposed)

    shared_ctx = contexts(mtp_model, n_ctx=1024, n_batch=64, n_seq_max=2, n_rs_seq=chain)
    engine.enable_target_rows(shared_ctx)
    shared_mtp = contexts(mtp_model, mtp=True, n_ctx=1024, n_seq_max=2)
    gate, together = PassGate(shared_ctx), Together(window=10**6)  # one turn: drafting beside each other
    mtp_gate = PassGate(shared_mtp, gate.room, first=True)
    lanes = [Lane(shared_ctx, range(i, i + 1), 512, gate) for i in range(2)]
    mtp_drafters = drafters(shared_mtp, 2, mtp_gate)
    decoders = [SpeculativeDecoder(mtp_model, shared_ctx, d, TreeShape.chain(chain), lane=lane, together=together)
                for d, lane in zip(mtp_drafters, lanes)]
    results: list = [None, None]

    def run(i: int) -> None:
        lanes[i].join()
        try:
            results[i] = token_ids(decoders[i], prompts[i], GREEDY, N_TOKENS)
        finally:
            lanes[i].leave()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    divergences += [compare(ref, out, N_TOKENS, f"together, prompt {k}") for k, (ref, out) in
                    enumerate(zip(references, results))]
    check_divergences([d for d in divergences if d], len(divergences), "MTP in shared passes")
    assert gate.shared_passes > 0 and mtp_gate.shared_passes > 0
    drafted_shared = [s for dec in decoders for s in dec.stats.steps if s.shared > 1 and s.tree_nodes > 0]
    assert drafted_shared, "the requests should have drafted with MTP beside each other"
    for drafter, proposed_alone in zip(mtp_drafters, alone):
        common = set(drafter.proposed) & set(proposed_alone)
        same = sum(drafter.proposed[k] == proposed_alone[k] for k in common)
        assert len(common) >= N_TOKENS // 2 and same >= 0.9 * len(common), (same, len(common))


def test_missing_staging_symbol_is_one_line(monkeypatch):
    """A libllama of another ABI: one EngineError naming the function, no traceback from ctypes."""
    from specrun.engine import mtp

    monkeypatch.setitem(mtp._STAGING, "set_nextn_layer_offset", ("_Z_no_such_symbol", [], None))
    monkeypatch.setattr(mtp, "_resolved", {})
    with pytest.raises(EngineError, match="does not export llama_set_nextn_layer_offset"):
        mtp.check_mtp_support()


def test_mtp_context_refuses_a_model_without_mtp_layers(offline_models, load_model):
    model = load_model(offline_models.smollm2_random)
    with pytest.raises(EngineError, match="no MTP layers"):
        engine.MtpContext(model, n_ctx=128)


# ------------------------------------------------------------------------------------------------
# Plan and command line


def test_plan_picks_mtp_for_a_target_that_carries_it(mtp_path):
    plan = build_plan(RunOptions(target=str(mtp_path), quiet=True), fetch=False)
    assert plan.drafter == "mtp" and plan.tree.drafting.loads_mtp and not plan.draft_loaded
    assert "carries MTP layers" in plan.why
    assert plan.tree.verify == "chain" and plan.tree.shape.depth == 3
    assert plan.target_ctx.n_rs_seq == 3
    explicit = build_plan(RunOptions(target=str(mtp_path), draft="mtp", depth=2, quiet=True), fetch=False)
    assert explicit.drafter == "mtp" and explicit.tree.shape.depth == 2 and explicit.why.startswith("--draft mtp")
    plain = build_plan(RunOptions(target=str(mtp_path), no_spec=True, quiet=True), fetch=False)
    assert plain.tree is None


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specrun", *args], capture_output=True, text=True, timeout=300)


def test_cli_greedy_mtp_equals_no_spec(mtp_path):
    common = ["generate", "--target", str(mtp_path), "-n", "16", "--temp", "0", "--ctx-size", "256", "List the planets."]
    plain = run_cli(*common, "--no-spec")
    mtp = run_cli(*common, "--draft", "mtp", "--json")
    assert plain.returncode == 0 and mtp.returncode == 0, plain.stderr + mtp.stderr
    result = json.loads(mtp.stdout)
    assert result["drafter"] == "mtp"
    assert result["text"] == plain.stdout.rstrip("\n")
    shown = run_cli("plan", "--target", str(mtp_path))
    assert shown.returncode == 0 and "drafter  mtp" in shown.stdout and "carries MTP layers" in shown.stdout


def test_cli_jsonl_lines_decode_together_with_mtp_as_without_speculation(mtp_path):
    """`generate --jsonl --parallel 2` on an MTP target: the lines decode together (a sequence of
    the MTP context each) and every answer is the one decoded without speculation."""
    lines = "".join(json.dumps({"id": i, "prompt": q}) + "\n" for i, q in
                    enumerate(["List the planets.", "Write a haiku about the sea.", "Name three colours."]))
    common = ["generate", "--target", str(mtp_path), "--jsonl", "-n", "12", "--temp", "0", "--ctx-size", "256"]
    plain = subprocess.run([sys.executable, "-m", "specrun", *common, "--no-spec"], input=lines,
                           capture_output=True, text=True, timeout=300)
    mtp = subprocess.run([sys.executable, "-m", "specrun", *common, "--parallel", "2"], input=lines,
                         capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0 and mtp.returncode == 0, plain.stderr + mtp.stderr
    assert "one at a time" not in mtp.stderr
    one, many = [json.loads(x) for x in plain.stdout.splitlines()], [json.loads(x) for x in mtp.stdout.splitlines()]
    assert [r["id"] for r in many] == [0, 1, 2]
    assert [r["token_ids"] for r in many] == [r["token_ids"] for r in one]
    assert all(r["drafter"] == "mtp" for r in many)
    assert sum(r["stats"]["shared_passes"] for r in many) > 0  # lines did decode together


def test_cli_draft_mtp_without_mtp_layers_is_one_line(offline_models):
    out = run_cli("generate", "--target", str(offline_models.smollm2_random), "--draft", "mtp", "-n", "2", "Hi")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and "no MTP layers" in out.stderr


def test_chat_says_the_mtp_layers_draft(mtp_path):
    """`specrun chat` named the draft model of an MTP run, which has none ("with draft None")."""
    out = subprocess.run([sys.executable, "-m", "specrun", "chat", "--target", str(mtp_path), "--ctx-size", "256",
                          "-n", "4"], input="Hi\n", capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    banner = next(line for line in out.stderr.splitlines() if line.startswith("specrun chat:"))
    assert "with its own MTP layers drafting (chains of 3)" in banner and "None" not in banner
