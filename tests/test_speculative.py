"""Speculative decoding produces exactly the target's output: tests on the real offline models.

The target is SmolLM2-135M in F32; drafts are its Q4_1 file (agrees ~99%) and a tiny random-weight
model with the same tokenizer (almost always wrong, so rejections and bonus tokens dominate).

Numerics: llama.cpp's CPU kernels round differently depending on how many tokens a batch holds,
so the target's logits for one position differ slightly (up to ~0.1) between plain decoding (one
token per pass) and a tree pass. At a near-tie the two can then legitimately pick different
tokens. Greedy comparisons therefore accept a difference only at the first differing position and
only when plain decoding's logits for the two tokens are within NEAR_TIE of each other; a real bug
diverges at a clear gap. Every near-tie divergence is recorded and printed.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest

from specrun import engine
from specrun.chat import templates
from specrun.core.sampling import SamplingParams, make_rng, target_probs
from specrun.core.tree_shapes import LONGEST_GROWN_CHAIN, NETWORK_SIZES, TreeShape
from specrun.decoding.calibration import DraftCalibration
from specrun.decoding.drafters.base import Drafter
from specrun.decoding.pay import counts
from specrun.decoding.batching import Lane
from specrun.decoding.drafters.best_first import READ_AHEAD, TreeGrower
from specrun.decoding.drafters.hybrid import HybridDrafter
from specrun.decoding.drafters.growing import GrowingTrees
from specrun.decoding import speculative
from specrun.decoding.plain import PlainDecoder
from specrun.decoding.speculative import SpeculativeDecoder
from specrun.decoding.stream import generate, token_ids
from specrun.errors import ContextFullError
from tiny_archs import tiny_arch_model

from conftest import MODEL_CACHE, TINY_THREADS, passes_a_round_trip_away

GREEDY = SamplingParams()

# Plain decoding's logit gap below which a divergence counts as a numerical near-tie.
NEAR_TIE = 0.05
# Plain logits kept per generated token to measure gaps at a divergence.
TOP_LOGITS = 8
# More near-tie divergences than this fraction of runs points at a bug, not at rounding.
MAX_NEAR_TIE_FRACTION = 0.05

N_CTX = 1024
TREE_BATCH = 512  # >= the largest matrix tree (256 nodes) + root

# Varied chat prompts: prose, code, lists, arithmetic, several languages, short and long answers.
CHAT_PROMPTS = [
    "Write a haiku about autumn leaves.",
    "Write a Python function that checks whether a string is a palindrome.",
    "List five countries in South America.",
    "Quelle est la capitale de l'Italie ? Réponds en une phrase.",
    "¿Cuál es el río más largo del mundo?",
    "Explain what a hash table is in two sentences.",
    "What is 17 + 25? Answer with the number only.",
    "Write a SQL query that counts the rows of a table named users.",
    "Give me three tips for better sleep, as a numbered list.",
    "Translate 'good morning' into German, Spanish and Italian.",
    "Write a JavaScript function that debounces another function.",
    "Write a bash command that counts the lines of all .py files in a directory.",
    "Name the planets of the solar system in order.",
    "Wie spät ist es in Tokio, wenn es in Berlin 12 Uhr ist?",
    "Say hello in Japanese and in Chinese.",
    "What is the difference between a list and a tuple in Python?",
    "Reply with the single word: yes.",
]
# Raw text continuations (no chat template).
RAW_PROMPTS = [
    "def fibonacci(n):\n",
    "1. Apples\n2. Bananas\n3.",
    "The history of the printing press begins",
]
# A prompt whose answer runs for hundreds of tokens: the long cases.
LONG_PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle."
LONG_TOKENS = 320

# Tree shape per budget: a chain-like single node, narrow and wide trees, and big best-first trees.
SHAPES = {
    1: TreeShape(budget=1, depth=8, width=1, top_k=1),
    4: TreeShape(budget=4, depth=4, width=2, top_k=2),
    16: TreeShape(budget=16, depth=6, width=4, top_k=4),
    64: TreeShape(budget=64, depth=6, width=8, top_k=8),
    256: TreeShape(budget=256, depth=8, width=8, top_k=16),
}
# Tokens generated per run, by draft and budget, sized for a 2-core CPU: a 257-token target pass
# costs ~20 plain tokens, growing a 256-node tree with the Q4_1 draft twice that (it decodes about
# one token per node, and batched Q4_1 is slower per token than the F32 target on this CPU), and
# the random draft gets ~1 token per pass. Small limits still give full-size first trees (depth is
# clamped to the tokens left), and all runs of a prompt reuse its cached KV prefix.
MATRIX_TOKENS = {
    "agreeing": {1: 16, 4: 16, 16: 16, 64: 8, 256: 8},
    "random": {1: 12, 4: 8, 16: 6, 64: 5, 256: 3},
}
# The long cases: (draft, budget), each generating LONG_TOKENS tokens.
LONG_CASES = [("agreeing", 4), ("random", 1)]


def chat_prompt(model, text: str, answer: str = "") -> list[int]:
    """Return the tokens of a one-turn chat in the model's template (as Runtime.tokenize_prompt)."""
    rendered = templates.render_chat(model.chat_template, [{"role": "user", "content": text}], add_generation_prompt=True)
    return model.tokenize(rendered + answer, add_special=True, parse_special=True)


# ------------------------------------------------------------------------------------------------
# Plain reference and comparison


@dataclass
class Reference:
    """Plain greedy decoding of one prompt, with its best logits at every generated position."""

    tokens: list[int]
    top_ids: list[np.ndarray] = field(default_factory=list)
    top_logits: list[np.ndarray] = field(default_factory=list)

    def gap(self, i: int, token: int) -> float | None:
        """Return plain's logit of its own token i minus its logit of `token`; None if not among the best."""
        ids, logits = self.top_ids[i], self.top_logits[i]
        mine = logits[ids == self.tokens[i]]
        other = logits[ids == token]
        if len(mine) == 0 or len(other) == 0:
            return None
        return float(mine[0] - other[0])


def plain_reference(plain: PlainDecoder, prompt: list[int], n: int) -> Reference:
    """Decode greedily with the plain decoder, keeping the best logits of every position."""
    ref = Reference([])
    for step in plain.steps(prompt, GREEDY, n, make_rng(0)):
        row = plain.ctx.logits_row(-1)  # the row the step's token was chosen from
        best = np.argpartition(row, -TOP_LOGITS)[-TOP_LOGITS:]
        ref.top_ids.append(best)
        ref.top_logits.append(row[best].copy())
        ref.tokens.extend(step.tokens)
    return ref


@dataclass
class Divergence:
    label: str
    position: int
    plain_token: int
    spec_token: int
    gap: float | None

    def __str__(self) -> str:
        gap = "not among plain's best" if self.gap is None else f"plain logit gap {self.gap:.4f}"
        return f"{self.label}: token {self.position}: plain {self.plain_token}, speculative {self.spec_token} ({gap})"


def compare(ref: Reference, out: list[int], n: int, label: str) -> Divergence | None:
    """Return None if `out` is plain's first n tokens, else where and how it first differs."""
    expected = ref.tokens[:n]
    if out == expected:
        return None
    i = next((i for i, (a, b) in enumerate(zip(expected, out)) if a != b), min(len(expected), len(out)))
    if i >= len(expected) or i >= len(out):
        return Divergence(f"{label} (length {len(out)}, plain {len(expected)})", i, -1, -1, None)
    return Divergence(label, i, expected[i], out[i], ref.gap(i, out[i]))


def is_near_tie(d: Divergence) -> bool:
    return d.plain_token >= 0 and d.gap is not None and d.gap < NEAR_TIE


def check_divergences(divergences: list[Divergence], n_runs: int, what: str) -> None:
    """Fail on any clear-gap divergence or too many near-ties; print the near-ties."""
    bad = [d for d in divergences if not is_near_tie(d)]
    ties = [d for d in divergences if is_near_tie(d)]
    print(f"\n{what}: {n_runs} runs, {len(ties)} near-tie divergence(s)")
    for d in ties:
        print(f"  near-tie: {d}")
    assert not bad, f"{what}: speculative output differs from plain decoding:\n" + "\n".join(map(str, bad))
    assert len(ties) <= max(1, MAX_NEAR_TIE_FRACTION * n_runs), f"{what}: {len(ties)} near-ties in {n_runs} runs is suspicious"


# ------------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def target(offline_models, load_model):
    return load_model(offline_models.smollm2_f32)


@pytest.fixture(scope="module")
def draft_models(offline_models, load_model, target):
    return {"agreeing": load_model(offline_models.smollm2_q4), "random": load_model(offline_models.smollm2_random)}


# Threads of each draft's context: the tiny random draft's passes gain nothing from a second
# (conftest.TINY_THREADS); the target and the Q4_1 draft run llama.cpp's default.
DRAFT_THREADS = {"agreeing": None, "random": TINY_THREADS}


class Contexts:
    """Contexts created by one test module, closed together."""

    def __init__(self):
        self.owned: list[engine.Context] = []

    def __call__(self, model, n_ctx=N_CTX, n_batch=TREE_BATCH, n_seq_max=engine.MAX_SEQ, threads=None) -> engine.Context:
        ctx = engine.Context(model, n_ctx=n_ctx, n_batch=n_batch, n_seq_max=n_seq_max, threads=threads)
        self.owned.append(ctx)
        return ctx

    def close(self):
        for ctx in self.owned:
            ctx.close()


@pytest.fixture(scope="module")
def contexts():
    owner = Contexts()
    yield owner
    owner.close()


@pytest.fixture(scope="module")
def plain(target, contexts) -> PlainDecoder:
    """The plain decoder every speculative output is compared with (its own context)."""
    return PlainDecoder(target, contexts(target, n_seq_max=1))


@pytest.fixture(scope="module")
def references(plain):
    """Return reference(prompt, n): plain greedy tokens, decoded once per prompt and reused."""
    cache: dict[tuple[int, ...], Reference] = {}

    def reference(prompt: list[int], n: int) -> Reference:
        key = tuple(prompt)
        ref = cache.get(key)
        if ref is None or (len(ref.tokens) < n and (not ref.tokens or ref.tokens[-1] not in plain.eog)):
            cache[key] = ref = plain_reference(plain, prompt, n)
        return ref

    return reference


def use_shape(spec: SpeculativeDecoder, shape: TreeShape) -> None:
    """Let one decoder (and its KV caches) run another tree shape: no re-prefill between budgets."""
    assert shape.budget + 1 <= spec.ctx.n_batch and shape.width <= spec.drafter.batch.capacity
    spec.shape = spec.drafter.shape = shape


@pytest.fixture(scope="module")
def spec_decoders(target, draft_models, contexts):
    """One speculative decoder per draft, each owning a target and a draft context."""
    widest = max(SHAPES.values(), key=lambda s: (s.budget, s.width))
    return {
        name: SpeculativeDecoder(target, contexts(target), TreeGrower(model, contexts(model, threads=DRAFT_THREADS[name]), widest),
                                 widest)
        for name, model in draft_models.items()
    }


@pytest.fixture(scope="module")
def prompts(target):
    chat = [chat_prompt(target, text) for text in CHAT_PROMPTS]
    raw = [target.tokenize(text, add_special=True, parse_special=False) for text in RAW_PROMPTS]
    return chat + raw


# ------------------------------------------------------------------------------------------------
# Greedy equality


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["agreeing", "random"])
def test_greedy_output_equals_plain_decoding(draft, prompts, references, spec_decoders):
    """Every budget, every prompt: the speculative tokens are plain greedy decoding's tokens."""
    assert len(prompts) >= 20
    spec = spec_decoders[draft]
    divergences, n_runs = [], 0
    seconds = dict.fromkeys(SHAPES, 0.0)
    t0 = time.perf_counter()
    for index, prompt in enumerate(prompts):
        ref = references(prompt, max(MATRIX_TOKENS[d][b] for d in MATRIX_TOKENS for b in SHAPES))
        for budget, shape in SHAPES.items():
            n = MATRIX_TOKENS[draft][budget]
            use_shape(spec, shape)
            t1 = time.perf_counter()
            out = token_ids(spec, prompt, GREEDY, n)
            seconds[budget] += time.perf_counter() - t1
            n_runs += 1
            assert len(out) <= n
            d = compare(ref, out, n, f"prompt {index}, {draft} draft, budget {budget}")
            if d:
                divergences.append(d)
            else:
                expected_reason = "eog" if out and out[-1] in spec.eog else "length"
                assert spec.stats.finish_reason == expected_reason
    per_budget = ", ".join(f"{b}: {t:.1f}" for b, t in seconds.items())
    print(f"\n{draft} draft: {n_runs} runs in {time.perf_counter() - t0:.1f} s (seconds by budget: {per_budget})")
    check_divergences(divergences, n_runs, f"greedy matrix, {draft} draft")


# (verified level, grown level) per step: the chain, a look at 16 grown and verified whole, 16
# grown and cut to the chain, the tree paying at 32 with 64 explored and cut, the size below
# re-timed on a cut. Which steps do which follows the clock in a run; here a script.
GROWTH_SCRIPT = [(0, 0), (0, 1), (0, 1), (1, 1), (1, 2), (2, 2), (2, 3), (1, 2), (3, 3), (0, 3)]


@pytest.mark.parametrize("draft", ["agreeing", "random"])
def test_greedy_through_trees_grown_online_equals_plain_decoding(draft, target, draft_models, contexts, prompts,
                                                                 references):
    """A tree grown online (decoding.drafters.growing) changes size from step to step, is grown
    larger than it is verified and cut, and its draft cache keeps only the accepted path: every
    kind of step, on the agreeing and the random-weight draft, gives plain greedy's tokens."""
    model = draft_models[draft]
    grower = TreeGrower(model, contexts(model, threads=DRAFT_THREADS[draft]), TreeShape(64, 24, 4, 2))
    growing = GrowingTrees(grower, TreeShape.chain(5), 64)
    assert growing.levels == (5, 16, 32, 64)
    script = iter(GROWTH_SCRIPT * 100)
    growing._choose = lambda: next(script)
    spec = SpeculativeDecoder(target, contexts(target), growing, TreeShape(64, 24, 4, 2))
    spec.path_alone = False  # (the whole tree in the pass, its first path read: the tree passes under test)
    divergences, sizes, n_runs = [], set(), 0
    for index, prompt in enumerate(prompts[:3]):
        ref = references(prompt, 40)
        out = token_ids(spec, prompt, GREEDY, 40)
        sizes |= {step.tree_nodes for step in spec.stats.steps}
        n_runs += 1
        if d := compare(ref, out, 40, f"prompt {index}, {draft} draft, grown online"):
            divergences.append(d)
    assert {5, 16, 32} <= sizes, sizes  # cut trees and whole ones were verified
    check_divergences(divergences, n_runs, f"trees grown online, {draft} draft")


@pytest.mark.parametrize("draft", ["agreeing", "random"])
@pytest.mark.parametrize("grown", [False, True], ids=["chain", "grown online"])
def test_greedy_with_the_draft_growing_its_tree_while_the_target_verifies_equals_plain_decoding(
        draft, grown, target, draft_models, contexts, prompts, references):
    """Where the target's pass runs elsewhere, the draft model grows its tree on meanwhile
    (engine.compute.start_beside; here the CPU runs both): the next step starts from the part
    below the target's next token, its draft cache kept, and cuts a chain to the draft's first
    choices. Every step still gives plain greedy's tokens; the agreeing draft takes tree nodes
    from the pass before."""
    model = draft_models[draft]
    grower = TreeGrower(model, contexts(model, threads=DRAFT_THREADS[draft]), TreeShape(64, 24, 4, 2))
    grower.shape = TreeShape.chain(5)
    drafter = GrowingTrees(grower, TreeShape.chain(5), 64) if grown else grower
    if grown:
        script = iter(GROWTH_SCRIPT * 100)
        drafter._choose = lambda: next(script)
    target_ctx = contexts(target)
    passes_a_round_trip_away(target_ctx)
    spec = SpeculativeDecoder(target, target_ctx, drafter, TreeShape(64, 24, 4, 2) if grown else TreeShape.chain(5))
    spec.overlap = True
    divergences, reused, n_runs = [], 0, 0
    for index, prompt in enumerate(prompts[:3]):
        ref = references(prompt, 40)
        out = token_ids(spec, prompt, GREEDY, 40)
        reused += spec.stats.as_dict()["reused_nodes"]
        if not grown:
            assert max(step.tree_nodes for step in spec.stats.steps) <= 5
        n_runs += 1
        if d := compare(ref, out, 40, f"prompt {index}, {draft} draft, drafting during the pass"):
            divergences.append(d)
    assert grower.extended > 0
    assert grower.prepared > 0  # the prompts were read during the target's prefill
    if draft == "agreeing":
        assert reused > 0
    check_divergences(divergences, n_runs, f"drafting during the target's pass, {draft} draft")


class _Uncalibrated(DraftCalibration):
    def judge(self, logps, first, taken) -> None:
        pass


def test_best_first_trees_scored_by_the_chances_the_run_measured_accept_further(target, draft_models, contexts,
                                                                                   prompts, references):
    """A Q4 draft of its own target is right far more often than its probabilities say: the
    grower measures it (adaptive.DraftCalibration, fed the target's choice at each node its tree
    reached), and its best-first trees then spend their nodes deeper, accepting more tokens a
    pass than the same trees scored by the draft's own probabilities. The tokens are plain
    greedy decoding's either way (only the order of nodes changes)."""
    model = draft_models["agreeing"]
    shape = TreeShape(16, 16, 1, 2)
    accepted, passes = {}, {}
    for label, calibration in (("calibrated", DraftCalibration()), ("draft's own", _Uncalibrated())):
        grower = TreeGrower(model, contexts(model), shape)
        grower.calibration = calibration
        spec = SpeculativeDecoder(target, contexts(target), grower, shape)
        accepted[label] = passes[label] = 0
        divergences = []
        for index, prompt in enumerate(prompts[:4]):
            ref = references(prompt, 64)
            out = token_ids(spec, prompt, GREEDY, 64)
            if index > 0:  # (the first answer calibrates)
                accepted[label] += sum(step.accepted for step in spec.stats.steps)
                passes[label] += len(spec.stats.steps)
            if d := compare(ref, out, 64, f"prompt {index}, {label} scores"):
                divergences.append(d)
        check_divergences(divergences, 4, f"best-first trees, {label} scores")
        if label == "calibrated":
            judged, share = calibration.first_choices()
            assert judged >= 64 and share >= 0.85, (judged, share)
            assert calibration.factors()[0, 2:6].min() > 1.2  # first choices at 0.2-0.6 taken far more often
    per_pass = {label: accepted[label] / passes[label] for label in accepted}
    print(f"\naccepted a pass: {per_pass}")
    assert per_pass["calibrated"] > 1.1 * per_pass["draft's own"], per_pass  # (8.1 against 6.3)


def test_a_prompt_read_before_the_first_proposal_leaves_only_the_root_to_catch_up(draft_models, contexts, prompts):
    """TreeGrower.prepare reads a prompt (while the target prefills it elsewhere): the first
    proposal then decodes the root alone, and proposes the tree it would have proposed without."""
    model = draft_models["agreeing"]
    shape = TreeShape(16, 8, 2, 2)
    prompt, root = prompts[0][:-1], prompts[0][-1]
    cold = TreeGrower(model, contexts(model), shape).propose(prompt, root, 16, 8)
    grower = TreeGrower(model, contexts(model), shape)
    grower.prepare(prompt, threading.Event())
    assert grower.prepared == len(prompt) and grower.debt(prompt, root) == 1
    warm = grower.propose(prompt, root, 16, 8)
    assert grower.last_catch_up[0] == 1
    assert warm.tree.tokens.tolist() == cold.tree.tokens.tolist()
    assert np.allclose(warm.tree.logps, cold.tree.logps, atol=1e-3)
    # A pass that has ended reads nothing more: the proposal catches up with all of it.
    late = TreeGrower(model, contexts(model), shape)
    ended = threading.Event()
    ended.set()
    late.prepare(prompt, ended)
    assert late.prepared == 0
    late.propose(prompt, root, 16, 8)
    assert late.last_catch_up[0] == len(prompt) + 1


def test_text_read_ahead_leaves_the_next_catch_up_the_root(draft_models, contexts, prompts):
    """TreeGrower.read_ahead reads the text (committed, root and a path the target may take) in
    short passes while the target's pass runs elsewhere: a later proposal keeps what agrees and
    decodes only its new root. Each pass holds what `fits()` allows; none once it says 0."""
    model = draft_models["agreeing"]
    shape = TreeShape(16, 8, 2, 2)
    text = prompts[0]
    committed, root, ahead = text[:-10], text[-10], text[-9:-4]
    grower = TreeGrower(model, contexts(model), shape)
    grower.read_ahead([*committed, root, *ahead], threading.Event())
    assert [n for n, _ in grower.last_read][:-1] == [READ_AHEAD] * (len(grower.last_read) - 1)
    assert sum(n for n, _ in grower.last_read) == len(committed) + 1 + len(ahead)
    assert all(s > 0 for _, s in grower.last_read)
    # the target took three of the path's tokens and then the text's own next one
    later, new_root = [*committed, root, *ahead[:3]], 1234
    cold = TreeGrower(model, contexts(model), shape).propose(later, new_root, 16, 8)
    warm = grower.propose(later, new_root, 16, 8)
    assert grower.last_catch_up[0] == 1
    assert warm.tree.tokens.tolist() == cold.tree.tokens.tolist()
    # bounded: passes of what fits, none where nothing does
    short = TreeGrower(model, contexts(model), shape)
    short.read_ahead(committed[:20], threading.Event(), fits=lambda: 3)
    assert [n for n, _ in short.last_read] == [3] * 6 + [2]
    none = TreeGrower(model, contexts(model), shape)
    none.read_ahead(committed, threading.Event(), fits=lambda: 0)
    assert none.last_read == [] and none.debt(committed, root) == len(committed) + 1


def test_a_hybrid_leaning_on_lookup_reads_the_text_while_the_target_verifies(draft_models, contexts, prompts):
    """A step that leans on lookup (or a plain one) runs no draft pass; where the target's pass
    runs elsewhere (extend), the draft model reads what it has not read meanwhile, and what
    those passes cost prices its later catch-ups. A drafting step after it catches up with its
    root alone."""
    model = draft_models["agreeing"]
    text = prompts[1]
    committed, root = text[:-1], text[-1]
    grower = TreeGrower(model, contexts(model), TreeShape.chain(5))
    hybrid = HybridDrafter(grower, 5, 64, catch_up_s=0.0024)
    hybrid.start(len(committed), 64)
    hybrid.propose_free(committed, root, 16, 8)  # (leans: no draft pass)
    assert not hybrid.drafted and grower.debt(committed, root) == len(committed) + 1
    hybrid.extend(threading.Event())
    assert grower.debt(committed, root) <= 1 and grower.last_read
    assert hybrid.draft_pass.known  # (the reading passes priced the draft's passes)
    grower.propose(committed, root, 5, 5)
    assert grower.last_catch_up[0] <= 1
    # a drafting step grows its tree instead (TreeGrower.extend), reading nothing
    hybrid.drafted = True
    grower.last_read = []
    hybrid.extend(threading.Event())
    assert grower.last_read == []


def test_a_short_chains_pass_grows_its_tree_as_deep_as_the_next_chains(draft_models, contexts, prompts):
    """While the target verifies a chain of 5 elsewhere, the draft grows on to twice its depth and
    one (11); sized online over a network (GrowingTrees.overlaps), as deep as a chain of
    LONGEST_GROWN_CHAIN's would (17), so that a look at that chain finds its nodes drafted."""
    model = draft_models["agreeing"]
    text = prompts[0]
    committed, root = text[:-1], text[-1]
    depths = {}
    for label, sized in (("alone", False), ("grown online", True)):
        grower = TreeGrower(model, contexts(model), TreeShape.chain(5))
        if sized:
            GrowingTrees(grower, TreeShape.chain(5), 384).overlaps()
        grower.propose(committed, root, 5, 5)
        grower.extend(threading.Event())  # (a pass that never ends: the tree's depth and budget stop it)
        depths[label] = grower._live.tree.max_depth
    assert depths["alone"] <= 11 < depths["grown online"] <= 2 * LONGEST_GROWN_CHAIN + 1, depths


def test_trees_verified_over_a_network_keep_to_its_node_counts(target, draft_models, contexts, prompts, references,
                                                              monkeypatch):
    """A target on RPC workers verifies trees cut to core.tree_shapes.NETWORK_SIZES (a chain of 7
    to its first 6 nodes): every pass one of a few shapes, the text plain greedy's."""
    monkeypatch.setattr(counts, "_MET", {})
    model = draft_models["agreeing"]
    spec = SpeculativeDecoder(target, contexts(target), TreeGrower(model, contexts(model), TreeShape.chain(7)),
                              TreeShape.chain(7))
    spec.network_sizes = True
    divergences = []
    for index, prompt in enumerate(prompts[:2]):
        out = token_ids(spec, prompt, GREEDY, 40)
        sizes = {step.tree_nodes for step in spec.stats.steps[1:]}
        assert sizes <= set(NETWORK_SIZES) and max(sizes) == 6, sizes
        if d := compare(references(prompt, 40), out, 40, f"prompt {index}, network sizes"):
            divergences.append(d)
    check_divergences(divergences, 2, "trees cut to the network's node counts")


def test_trees_verified_over_a_network_are_filled_to_a_node_count_met_before(target, draft_models, contexts, prompts,
                                                                            references, monkeypatch):
    """Over RPC workers a pass over a token count not met before in the process costs round trips
    (ggml-rpc asks the worker its shapes' sizes): a chain cut short by the answer's end is filled
    below its best path to the count its full chains met, and the text stays plain greedy's."""
    monkeypatch.setattr(counts, "_MET", {})
    model = draft_models["agreeing"]
    spec = SpeculativeDecoder(target, contexts(target), TreeGrower(model, contexts(model), TreeShape.chain(5)),
                              TreeShape.chain(5))
    spec.network_sizes, spec.network_s = True, 10.0  # (a slow network: filler always pays)
    shaped, shape = [], spec._network_shape
    spec._network_shape = lambda tree, kept, *rest: shaped.append((len(tree), len(shape(tree, kept, *rest)[0]))) \
        or shape(tree, kept, *rest)
    divergences = []
    for index, prompt in enumerate(prompts[:3]):
        out = token_ids(spec, prompt, GREEDY, 23)
        assert {step.tree_nodes for step in spec.stats.steps[1:]} <= {0, 5}
        if d := compare(references(prompt, 23), out, 23, f"prompt {index}, filled to met counts"):
            divergences.append(d)
    assert any(after > before for before, after in shaped), shaped  # short chains were filled
    check_divergences(divergences, 3, "trees filled to the network's met node counts")


def test_a_tree_that_reaches_the_answers_end_over_a_network_is_filled_beyond_twice_its_size(
        target, draft_models, contexts, prompts, references, monkeypatch):
    """The last step of an answer cut its chain of 32 to the 6 nodes the answer had left: 200 ms
    from the worker that new count cost 2.04 s against 0.44. Where the filler's price is timed
    (the counts around it met twice), that pass is filled to the chain's count, however far
    beyond twice its size; the text stays plain greedy's."""
    monkeypatch.setattr(counts, "_MET", {})
    met = counts.met_counts(target)
    for _ in range(2):  # (a count's first pass is not timed: a count below the chain's, timed)
        met.note(2, 0.02, tree=True)
    model = draft_models["agreeing"]
    spec = SpeculativeDecoder(target, contexts(target), TreeGrower(model, contexts(model), TreeShape.chain(32)),
                              TreeShape.chain(32))
    spec.network_sizes, spec.network_s = True, 10.0  # (a slow network: a timed filler pays)
    shaped, shape = [], spec._network_shape
    spec._network_shape = lambda tree, kept, room, ending=False: shaped.append((len(tree), ending, len(
        shape(tree, kept, room, ending)[0]))) or shape(tree, kept, room, ending)
    ends, divergences = [], []
    for index, prompt in enumerate(prompts[:3]):
        shaped.clear()
        out = token_ids(spec, prompt, GREEDY, 72)
        ends.extend(after for before, ending, after in shaped if ending and 2 * before + 8 < after)
        assert all(after in (1, 2, 33) for before, ending, after in shaped if ending), shaped  # no new count
        if d := compare(references(prompt, 72), out, 72, f"prompt {index}, filled at the answer's end"):
            divergences.append(d)
    assert ends and set(ends) == {33}, ends  # some answer's last chain was filled to the chain's count
    check_divergences(divergences, 3, "trees filled at the answer's end")


def test_repeat_guess_copies_what_followed_the_last_token_before():
    assert speculative._repeat_guess([7, 1, 2, 3, 9, 7], 3) == [1, 2, 3]
    assert speculative._repeat_guess([7, 1, 7], 3) == [1, 7, 7]
    assert speculative._repeat_guess([4, 5], 2) == [5, 5]


@pytest.mark.slow
def test_greedy_long_generations_equal_plain_decoding(target, references, spec_decoders):
    """Hundreds of tokens per prompt: KV bookkeeping holds over many steps."""
    divergences = []
    prompt = chat_prompt(target, LONG_PROMPT)
    ref = references(prompt, LONG_TOKENS)
    assert len(ref.tokens) >= 300, "pick a prompt with a longer answer"
    for draft, budget in LONG_CASES:
        spec = spec_decoders[draft]
        use_shape(spec, SHAPES[budget])
        out = token_ids(spec, prompt, GREEDY, LONG_TOKENS)
        d = compare(ref, out, LONG_TOKENS, f"long story, {draft} draft, budget {budget}")
        if d:
            divergences.append(d)
        print(f"\n{draft} budget {budget}: {spec.stats.as_dict()}")
    check_divergences(divergences, len(LONG_CASES), "long generations")


# ------------------------------------------------------------------------------------------------
# Sampling is exact


class RecordingGrower(Drafter):
    """Wraps a TreeGrower and keeps every tree it grew (to compare walks with the draft's trees)
    and the tokens of each path it was told to commit (checked to be a path of its tree)."""

    def __init__(self, grower: TreeGrower):
        self.grower = grower
        self.trees = []
        self.committed: list[list[int]] = []

    def propose(self, *args, **kwargs):
        grown = self.grower.propose(*args, **kwargs)
        self.trees.append(grown.tree)
        return grown

    def commit(self, grown, nodes) -> None:
        tree = grown.tree
        assert nodes[0] == 0 and all(tree.parents[b] == a for a, b in zip(nodes, nodes[1:])), nodes
        self.committed.append([int(tree.tokens[n]) for n in nodes[1:]])
        self.grower.commit(grown, nodes)


SAMPLES = 2000
SAMPLING_PROMPT = "Hi"
# A tree deep enough for all three tokens, wider than the draft's best guess.
SAMPLING_SHAPE = TreeShape(budget=6, depth=2, width=2, top_k=3)
MIN_BIN = 10  # outcomes seen fewer times (both runs together) share a bin with their prefix


def first_tokens(decoder, prompt, params, rng) -> tuple[int, ...]:
    return tuple(t for step in decoder.steps(prompt, params, 4, rng) for t in step.tokens)


def binned(samples_a: list[tuple], samples_b: list[tuple]) -> np.ndarray:
    """Return a 2 x bins count table: each outcome in the bin of its longest prefix seen >= MIN_BIN times.

    Bins left with fewer than MIN_BIN outcomes in total are pooled into one.
    """
    counts = Counter(s[:k] for s in samples_a + samples_b for k in range(len(s) + 1))

    def bin_of(s):
        return next(s[:k] for k in range(len(s), -1, -1) if counts[s[:k]] >= MIN_BIN)

    keys = sorted({bin_of(s) for s in samples_a + samples_b})
    index = {key: i for i, key in enumerate(keys)}
    table = np.zeros((2, len(keys)), np.int64)
    for row, samples in enumerate((samples_a, samples_b)):
        for s in samples:
            table[row, index[bin_of(s)]] += 1
    small = table.sum(axis=0) < MIN_BIN
    return np.column_stack([table[:, ~small], table[:, small].sum(axis=1)]) if small.any() else table


@pytest.fixture(scope="module")
def tiny_pair(offline_models, load_model, contexts):
    """The tiny random model as target and as its own draft: a fraction of a millisecond a pass,
    peaked but context-dependent (its plain samples: conftest's tiny_plain_samples).

    2000 speculative runs of the real pair would take minutes on a 2-core CPU; the walk under
    test does not care which model produced the logits.
    """
    tiny = load_model(offline_models.smollm2_random)
    spec = SpeculativeDecoder(tiny, contexts(tiny, n_ctx=256, n_batch=64, threads=TINY_THREADS),
                              TreeGrower(tiny, contexts(tiny, n_ctx=256, n_batch=64, threads=TINY_THREADS), SAMPLING_SHAPE),
                              SAMPLING_SHAPE)
    return tiny, spec


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=4, top_p=0.9)],
    ids=["temperature-1", "top-k-top-p"],
)
def test_sampled_first_tokens_have_plain_distribution(params, tiny_pair, tiny_plain_samples):
    """Chi-square: the first 4 sampled tokens follow the same distribution as plain sampling (the
    first comes from the prefill, the others through trees)."""
    from scipy.stats import chi2_contingency

    model, spec = tiny_pair
    prompt = chat_prompt(model, SAMPLING_PROMPT)
    t0 = time.perf_counter()
    plain_samples = tiny_plain_samples(first_tokens, prompt, params, 1, SAMPLES)
    t1 = time.perf_counter()
    spec_rng = make_rng(2)
    spec_samples, accepted = [], 0
    for _ in range(SAMPLES):
        spec_samples.append(first_tokens(spec, prompt, params, spec_rng))
        accepted += sum(len(s.tokens) - 1 for s in spec.stats.steps)
    t2 = time.perf_counter()
    table = binned(plain_samples, spec_samples)
    p_value = chi2_contingency(table).pvalue
    print(
        f"\n{params}: plain {t1 - t0:.1f} s, speculative {t2 - t1:.1f} s, {table.shape[1]} bins, "
        f"{accepted / SAMPLES:.2f} draft tokens accepted per run, p = {p_value:.3g}"
    )
    assert accepted > SAMPLES / 4, "the draft should be right often enough to exercise acceptance"
    assert table.shape[1] >= 10, "too few bins for a meaningful test"
    assert p_value >= 1e-3, f"speculative sampling differs from plain sampling (p = {p_value:.2g})\n{table}"


def test_seeded_sampling_emits_plain_tokens(target, contexts, plain, draft_models):
    """With one seed, speculative and plain sampling emit the same tokens (one uniform per token).

    Rounding moves the CDF a little, and the filters' cut-offs can move a token's whole mass, so
    a draw close to an interval edge may land on a neighbour (often: a 49k-token tail holds many
    intervals narrower than the shift). A difference is accepted only if plain's interval for
    the speculative token lies within DRAW_EDGE of the uniform both runs drew there.
    """
    DRAW_EDGE = 0.02
    configs = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02)]
    draft = draft_models["agreeing"]
    spec = SpeculativeDecoder(target, contexts(target, n_ctx=512, n_batch=64), TreeGrower(draft, contexts(draft, n_ctx=512, n_batch=64), SHAPES[4]), SHAPES[4])
    prompts = [chat_prompt(target, t) for t in ("Write a haiku about the sea.", "Give me three names for a cat.")]
    n_tokens, runs, same, compared = 16, 0, 0, 0
    near_edge = []
    for params in configs:
        for seed in range(2):
            for prompt in prompts:
                tokens, cdfs = [], []
                for step in plain.steps(prompt, params, n_tokens, make_rng(seed)):
                    cdfs.append(np.cumsum(target_probs(plain.ctx.logits_row(-1), params)))
                    tokens.extend(step.tokens)
                out = token_ids(spec, prompt, params, n_tokens, seed=seed)
                runs += 1
                i = next((i for i, (a, b) in enumerate(zip(tokens, out)) if a != b), None)
                if i is None:
                    assert out == tokens, f"seed {seed}: lengths differ ({len(out)} vs {len(tokens)})"
                    same += 1
                    compared += len(out)
                    continue
                compared += i
                u = make_rng(seed).random(i + 1)[i]  # the i-th uniform drew token i in both runs
                cdf, b = cdfs[i], out[i]
                lo, hi = (cdf[b - 1] if b else 0.0), cdf[b]
                distance = max(lo - u, u - hi, 0.0)
                near_edge.append(("filtered" if params.top_k else "T=1", seed, i, round(float(distance), 5)))
                assert distance < DRAW_EDGE, (
                    f"seed {seed}, {params}: token {i} is {b} (plain: {tokens[i]}), whose plain interval "
                    f"[{lo:.4f}, {hi:.4f}) is {distance:.3f} away from the draw {u:.4f}"
                )
    print(f"\nseeded sampling: {runs} runs, {same} identical, {compared} tokens compared; near-edge draws: {near_edge}")
    assert compared >= runs * n_tokens // 3, "runs should agree for a good part of their tokens"


# ------------------------------------------------------------------------------------------------
# The target as its own draft


@pytest.fixture(scope="module")
def twin(offline_models, load_model, target):
    """The target's file loaded a second time, as a draft."""
    model = load_model(offline_models.smollm2_f32, n_gpu_layers=0)
    assert model is not target
    return model


def greedy_path(tree) -> list[int]:
    """Tokens along the draft's best child from the root down (children are stored best first)."""
    node, tokens = 0, []
    while tree.children(node):
        node = tree.children(node)[0]
        tokens.append(int(tree.tokens[node]))
    return tokens


@pytest.mark.parametrize(
    "shape", [TreeShape.chain(4), TreeShape(budget=16, depth=6, width=4, top_k=4)], ids=["chain", "tree"]
)
def test_target_as_its_own_draft_accepts_the_whole_greedy_path(shape, target, twin, contexts, prompts, references):
    """Each step accepts the draft's greedy path to its end (the full depth for a chain).

    Only rounding can stop a path early, so every miss must be a near-tie in plain's logits.
    """
    draft_ctx = contexts(twin, n_ctx=N_CTX, n_batch=64)
    grower = RecordingGrower(TreeGrower(twin, draft_ctx, shape))
    spec = SpeculativeDecoder(target, contexts(target, n_ctx=N_CTX, n_batch=64), grower, shape)
    n, n_steps, misses, divergences = 24, 0, [], []
    for index in (0, 1, 12):
        prompt = prompts[index]
        ref = references(prompt, n)
        grower.trees.clear()
        out = token_ids(spec, prompt, GREEDY, n)
        d = compare(ref, out, n, f"prompt {index}")
        if d:
            divergences.append(d)
        agree_until = d.position if d else len(out)
        trees = iter(grower.trees)
        offset = 0
        for step in spec.stats.steps:
            if offset >= agree_until:
                break
            if step.tree_nodes == 0:
                offset += len(step.tokens)
                continue
            tree = next(trees)
            path = greedy_path(tree)
            if shape.width == 1:
                remaining = n - offset
                assert step.tree_depth == min(shape.depth, remaining - 1)
            n_steps += 1
            emitted = step.tokens
            ended = emitted[-1] in spec.eog and emitted == path[: len(emitted)]
            if not ended and not (emitted[:-1] == path and len(emitted) == len(path) + 1):
                j = next(j for j, (a, b) in enumerate(zip(emitted, path)) if a != b)
                miss = Divergence(f"prompt {index} step at token {offset}", offset + j, emitted[j], path[j], ref.gap(offset + j, path[j]))
                if offset + j < agree_until:
                    misses.append(miss)
            offset += len(emitted)
    check_divergences(divergences, 3, f"self-draft {shape} output")
    print(f"self-draft {shape}: {n_steps} steps, {len(misses)} stopped before the end of the greedy path")
    for m in misses:
        print(f"  {m}")
    assert all(is_near_tie(m) for m in misses), "\n".join(map(str, misses))
    assert len(misses) <= max(1, 0.1 * n_steps)


# ------------------------------------------------------------------------------------------------
# Edge cases

SMALL_CTX = 256  # llama.cpp's smallest context with 256 sequences


@pytest.fixture(scope="module")
def small(target, draft_models, contexts):
    """A plain and a speculative decoder (budget 64) in 256-token contexts."""
    plain = PlainDecoder(target, contexts(target, n_ctx=SMALL_CTX, n_batch=SMALL_CTX, n_seq_max=1))
    draft = draft_models["agreeing"]
    spec_ctx = contexts(target, n_ctx=SMALL_CTX, n_batch=SMALL_CTX)
    spec = SpeculativeDecoder(target, spec_ctx, TreeGrower(draft, contexts(draft, n_ctx=SMALL_CTX, n_batch=SMALL_CTX), SHAPES[64]), SHAPES[64])
    assert spec_ctx.n_ctx == plain.ctx.n_ctx == SMALL_CTX
    return plain, spec


def prompt_of_length(model, n: int) -> list[int]:
    text = "The old lighthouse stood on the cliff above the harbour, and every night its keeper climbed the stairs. "
    tokens = model.tokenize(text * (n // 10 + 1), add_special=True, parse_special=False)
    return tokens[:n]


def test_tree_budget_larger_than_the_room_left(small, target):
    """Near the end of the context the tree shrinks to fit; output still equals plain decoding."""
    plain, spec = small
    prompt = prompt_of_length(target, 200)
    ref = plain_reference(plain, prompt, 500)
    out = token_ids(spec, prompt, GREEDY, 500)
    assert plain.stats.finish_reason == spec.stats.finish_reason == "context"
    assert len(ref.tokens) == SMALL_CTX - len(prompt) + 1
    check_divergences([d for d in [compare(ref, out, 500, "budget 64 in a full context")] if d], 1, "context end")
    # Every tree fit the room left (root + nodes), and the last ones were cut below the budget.
    cached, clamped = len(prompt) - 1, 0
    for s in spec.stats.steps:
        room = SMALL_CTX - cached
        assert s.tree_nodes <= room - 1
        clamped += 0 < s.tree_nodes < 64
        cached += len(s.tokens)
    assert clamped >= 1
    assert spec.ctx.seq_pos_max(0) == SMALL_CTX - 1


def test_prompt_filling_the_context(small, target):
    plain, spec = small
    for decoder in (plain, spec):
        with pytest.raises(ContextFullError, match="context holds"):
            token_ids(decoder, prompt_of_length(target, SMALL_CTX), GREEDY, 8)
    # One free cell besides the prompt: two tokens fit (the last one is never cached).
    prompt = prompt_of_length(target, SMALL_CTX - 1)
    ref = plain_reference(plain, prompt, 8)
    out = token_ids(spec, prompt, GREEDY, 8)
    assert len(ref.tokens) == 2 and spec.stats.finish_reason == plain.stats.finish_reason == "context"
    check_divergences([d for d in [compare(ref, out, 8, "prompt filling the context")] if d], 1, "full prompt")


def test_one_token(spec_decoders, prompts, references):
    spec = spec_decoders["agreeing"]
    use_shape(spec, SHAPES[16])
    for prompt in prompts[:3]:
        out = token_ids(spec, prompt, GREEDY, 1)
        assert out == references(prompt, 1).tokens[:1]
        (step,) = spec.stats.steps
        assert step.tree_nodes == 0 and spec.stats.finish_reason == "length"


@pytest.mark.parametrize("draft", ["agreeing", "random"])
def test_end_of_generation_as_the_first_token(draft, target, spec_decoders, references):
    """An assistant turn that already ended: the first token is end-of-generation, nothing more."""
    prompt = chat_prompt(target, "Reply with the single word: yes.", answer="Yes.")
    ref = references(prompt, 8)
    assert len(ref.tokens) == 1 and ref.tokens[0] in target.eog_tokens
    best, second = np.sort(ref.top_logits[0])[-2:][::-1]
    assert best - second > NEAR_TIE, "pick a prompt where end-of-generation is a clear first choice"
    spec = spec_decoders[draft]
    use_shape(spec, SHAPES[16])
    result = generate(spec, target, prompt, GREEDY, max_tokens=8)
    assert result.tokens == ref.tokens
    assert result.text == "" and result.stats.finish_reason == "eog" and result.stats.n_generated == 1


def test_end_of_generation_inside_the_tree(target, contexts, draft_models, references):
    """An end-of-generation token accepted inside a tree ends the output right there."""
    draft = draft_models["agreeing"]
    grower_ctx = contexts(draft, n_ctx=512, n_batch=64)
    grower = RecordingGrower(TreeGrower(draft, grower_ctx, SHAPES[16]))
    spec = SpeculativeDecoder(target, contexts(target, n_ctx=512, n_batch=64), grower, SHAPES[16])
    prompt = chat_prompt(target, "What is 17 + 25? Answer with the number only.")
    ref = references(prompt, 32)
    assert ref.tokens[-1] in target.eog_tokens and len(ref.tokens) < 32
    out = token_ids(spec, prompt, GREEDY, 32)
    assert out == ref.tokens and spec.stats.finish_reason == "eog"
    # The last step walked the tree down to the end-of-generation node: no bonus after it.
    last, tree = spec.stats.steps[-1], grower.trees[-1]
    node = 0
    for token in last.tokens:
        node = tree.find_child(node, token)
        assert node is not None, "end-of-generation came as a bonus token, not from the tree"
    # A limit one short of the end stops before it and is never exceeded.
    out = token_ids(spec, prompt, GREEDY, len(ref.tokens) - 1)
    assert out == ref.tokens[:-1] and spec.stats.finish_reason == "length"


def test_tree_at_the_leaf_cap_gives_plain_output(target, contexts, draft_models, prompts, references):
    """A 600-node, depth-2, 64-wide tree is cut to 256 leaves (one sequence each) and still verifies."""
    shape = TreeShape(budget=600, depth=2, width=64, top_k=64)
    draft = draft_models["agreeing"]
    spec = SpeculativeDecoder(target, contexts(target, n_ctx=N_CTX, n_batch=640), TreeGrower(draft, contexts(draft, n_ctx=N_CTX, n_batch=64), shape), shape)
    spec.cells_in_order = False  # as on a GPU: the whole tree verified (on this CPU, under 64 tokens)
    out = token_ids(spec, prompts[2], GREEDY, 8)
    leaves = [s.tree_leaves for s in spec.stats.steps]
    assert max(leaves) == 256 and all(s.tree_nodes <= 600 for s in spec.stats.steps), leaves
    check_divergences([d for d in [compare(references(prompts[2], 8), out, 8, "leaf cap")] if d], 1, "leaf cap")


def test_a_lane_of_few_sequences_verifies_the_best_part_of_a_wider_tree(target, contexts, draft_models, prompts,
                                                                          references):
    """A leaf takes a sequence of the lane (a sliding-window target's plan opens WINDOW_LEAVES and
    the text's). A tree with more leaves is verified in its best part with as many leaves as the
    lane has; the drafter is told the accepted path in its own tree's ids, and the answer is plain
    decoding's."""
    shape = TreeShape(budget=40, depth=4, width=8, top_k=4)
    draft = draft_models["agreeing"]
    ctx = contexts(target, n_ctx=N_CTX, n_batch=64, n_seq_max=8)
    grower = RecordingGrower(TreeGrower(draft, contexts(draft, n_ctx=N_CTX, n_batch=64), shape))
    spec = SpeculativeDecoder(target, ctx, grower, shape, lane=Lane(ctx, range(4)))
    spec.path_alone = False  # (the whole tree in the pass, its first path read: the tree passes under test)
    n = 48
    out = token_ids(spec, prompts[0], GREEDY, n)
    steps = spec.stats.steps[1:]
    leaves = [len(tree.leaves()) for tree in grower.trees]
    assert max(leaves) > 4 >= max(step.tree_leaves for step in steps), (leaves, steps)
    assert max(step.tree_nodes for step in steps) > 4  # nodes are not capped by the sequences
    # each commit is the accepted path of its step, in the proposal's ids
    accepted = [step.tokens[:step.accepted] for step in steps if step.tree_nodes]
    assert grower.committed == accepted and sum(map(len, accepted)) > n // 3
    check_divergences([d for d in [compare(references(prompts[0], n), out, n, "best part")] if d], 1, "best part")


# ------------------------------------------------------------------------------------------------
# KV bookkeeping and stats


def test_kv_caches_hold_exactly_the_committed_tokens(target, spec_decoders, prompts, references, monkeypatch):
    spec = spec_decoders["agreeing"]
    use_shape(spec, SHAPES[16])
    prompt = prompts[9]
    out = token_ids(spec, prompt, GREEDY, 24)
    committed = list(spec.cache.tokens)
    # Everything emitted is cached except a final bonus token (the root of the next tree).
    assert len(committed) in (len(prompt) + len(out) - 1, len(prompt) + len(out))
    assert committed == (prompt + out)[: len(committed)]
    ctx = spec.ctx
    assert (ctx.seq_pos_min(0), ctx.seq_pos_max(0)) == (0, len(committed) - 1)
    assert [c for c in range(1, engine.MAX_SEQ) if ctx.seq_pos_max(c) != -1] == [], "tree colours left in the target cache"
    # The draft keeps what it computed for the accepted path, and nothing else. It may lag by a
    # leaf it never decoded, and by one more token when the last step had room for one token only
    # and ran without a tree (its root went to the target alone); the next catch-up adds both.
    grower = spec.drafter
    drafted = list(grower.cache.tokens)
    assert drafted == committed[: len(drafted)] and len(drafted) >= len(committed) - 2
    assert grower.ctx.seq_pos_max(0) == len(drafted) - 1
    assert [c for c in range(1, engine.MAX_SEQ) if grower.ctx.seq_pos_max(c) != -1] == [], "tree sequences left in the draft cache"

    # The next turn extends the conversation: both models decode only its new tokens.
    follow = prompt + out + target.tokenize("\n<|im_start|>user\nNow say it in French.<|im_end|>\n<|im_start|>assistant\n", add_special=False, parse_special=True)
    draft_batches = []
    draft_decode = grower.ctx.decode
    monkeypatch.setattr(grower.ctx, "decode", lambda batch: (draft_batches.append(batch.n_tokens), draft_decode(batch))[1])
    out2 = token_ids(spec, follow, GREEDY, 16)
    assert spec.stats.n_prefilled == len(follow) - len(committed)  # the first token comes from the prefill
    assert draft_batches[0] == len(follow) + 1 - len(drafted)  # the draft's catch-up: new tokens + root
    check_divergences([d for d in [compare(references(follow, 16), out2, 16, "follow-up turn")] if d], 1, "follow-up turn")


def test_step_stats_describe_each_pass(spec_decoders, prompts):
    spec = spec_decoders["agreeing"]
    shape = SHAPES[16]
    use_shape(spec, shape)
    out = token_ids(spec, prompts[1], GREEDY, 32)
    stats = spec.stats
    assert stats.n_generated == len(out) == sum(len(s.tokens) for s in stats.steps)
    with_tree = [s for s in stats.steps if s.tree_nodes]
    assert len(with_tree) >= len(stats.steps) - 2
    first = stats.steps[0]  # the first token comes from the prompt's prefill: no pass of its own
    assert len(first.tokens) == 1 and first.tree_nodes == 0 and first.target_s == 0
    for s in stats.steps[1:]:
        assert 1 <= len(s.tokens) <= s.tree_depth + 1
        assert s.target_s > 0 and s.total_s >= s.target_s + s.draft_s and s.overhead_s >= 0
    for s in with_tree:
        assert 1 <= s.tree_nodes <= shape.budget and 1 <= s.tree_depth <= shape.depth
        assert 1 <= s.tree_leaves <= s.tree_nodes and s.draft_s > 0 and s.draft_passes >= 1
        assert len(s.path_ranks) == len(s.tokens) - 1 and all(1 <= r <= s.tree_nodes for r in s.path_ranks)
    summary = stats.as_dict()
    assert summary["n_passes"] == len(stats.steps) < len(out)
    assert summary["accepted_per_pass"] == pytest.approx(len(out) / len(stats.steps), abs=1e-3)
    assert stats.accepted_per_pass > 1.5, "the agreeing draft should give several tokens per pass"
    assert summary["tokens_per_s"] > 0 and summary["target_s"] > 0 and summary["draft_s"] > 0
    assert summary["decode_s"] == pytest.approx(stats.total("total_s"), rel=1e-3, abs=1e-3)
    assert summary["mean_tree_nodes"] > 1



class WidenedGrower(TreeGrower):
    """A draft tree with one more leaf beside its first token (one no child of the root holds):
    every pass has two tree colours, however sure the draft is."""

    def propose(self, committed, root, budget, depth):
        grown = super().propose(committed, root, budget - 1, depth)
        tree, taken = grown.tree.copy(), {int(grown.tree.tokens[c]) for c in grown.tree.children(0)}
        tree.add(0, next(t for t in range(self.model.n_vocab - 1, 0, -1) if t not in taken), -30.0)
        grown.tree = tree
        return grown


def test_trees_on_a_window_sized_cache_give_back_the_cells_behind_the_window(load_model):
    """Issue 33: a sliding-window target's trees run on llama.cpp's window-sized cache (a window
    per sequence and a batch), not one of every cell. Tree colours hold the committed text in
    several sequences, whose cells llama.cpp never reuses: without giving back the cells behind
    the window, accepted tokens fill such a cache long before the context (here, gpt-oss's layout
    with a 128-token window and three sequences: 512 cells, full after about 500 tokens of a
    2,048-token context). The answer is the one trees give on a cache of every cell, token for
    token, and plain decoding's but for near-ties (random weights have some)."""
    model = load_model(tiny_arch_model(MODEL_CACHE, "gpt-oss"))
    prompt = model.tokenize("One two three four five six seven eight nine ten")
    n = 1500
    with engine.Context(model, n_ctx=2048, n_batch=64, n_seq_max=1, swa_full=False, threads=TINY_THREADS) as plain_ctx:
        reference = plain_reference(PlainDecoder(model, plain_ctx), prompt, n)
    assert len(reference.tokens) == n  # (an answer that long: the window's cells are passed many times over)
    shape = TreeShape(budget=6, depth=5, width=1, top_k=1)
    answers = {}
    for swa_full in (False, True):
        with engine.Context(model, n_ctx=2048, n_batch=64, n_seq_max=3, swa_full=swa_full, threads=TINY_THREADS) as ctx, \
                engine.Context(model, n_ctx=2048, n_batch=64, n_seq_max=64, threads=TINY_THREADS) as draft_ctx:
            assert ctx.window == (0 if swa_full else model.n_swa) and model.n_swa == 128
            spec = SpeculativeDecoder(model, ctx, WidenedGrower(model, draft_ctx, shape), shape, lane=Lane(ctx, range(2)))
            spec.path_alone = False  # (the whole tree in the pass, its first path read: the tree passes under test)
            answers[swa_full] = token_ids(spec, prompt, GREEDY, n)
            # every token but the first and the last from a pass over two colours
            assert sum(len(step.tokens) for step in spec.stats.steps if step.tree_leaves == 2) >= n - 2
            if not swa_full:
                assert spec.cache.compacted > 0  # the cells behind the window were given back, and the
                # window layers hold the window and at most the tokens since they last gave back
                assert len(prompt) + n - 3 * 128 < ctx.seq_pos_min(0) <= len(prompt) + n - 128
    assert answers[False] == answers[True]
    divergence = compare(reference, answers[False], n, "trees on a window-sized cache")
    check_divergences([divergence] if divergence else [], 1, "trees on a window-sized cache")
