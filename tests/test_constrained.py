"""Grammars, JSON schemas, penalties, logit_bias and log-probs on the real offline models: the
speculative output (draft trees, lookup, hybrid) is exactly plain decoding's under the same rules.

Same target and drafts as test_speculative.py (SmolLM2-135M F32; its Q4_1 file as the draft).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import jsonschema
import numpy as np
import pytest
from conftest import TINY_THREADS
from test_lookup_decoding import contexts, draft, hybrid_decoder, lookup_decoder, target  # noqa: F401 (fixtures)
from test_speculative import SHAPES, binned, chat_prompt, first_tokens

from specrun.core.sampling import SamplingParams, make_rng
from specrun.core.tree_shapes import TreeShape
from specrun.decoding.drafters.best_first import TreeGrower
from specrun.decoding.drafters.lookup import LookupDrafter
from specrun.decoding.plain import PlainDecoder
from specrun.decoding.speculative import SpeculativeDecoder
from specrun.engine.grammar import Grammar
from specrun.errors import UsageError

N_CTX = 1024
TOKENS = 24
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colour": {"enum": ["red", "green", "blue"]},
        "pets": {"type": "array", "items": {"type": "object", "properties": {"kind": {"type": "string", "maxLength": 12}},
                                            "required": ["kind"], "additionalProperties": False}, "maxItems": 2},
        "email": {"type": "string", "format": "email"},
    },
    "required": ["name", "age", "colour", "pets"],
    "additionalProperties": False,
}
SCHEMA_PROMPTS = ["Describe a person as JSON.", "Give me a JSON record for a pet owner."]
FREE_PROMPTS = ["Write a haiku about autumn leaves.", "List five countries in South America."]
PENALISED = SamplingParams(presence_penalty=0.6, frequency_penalty=0.8, repeat_penalty=1.1,
                           logit_bias=((13, 4.0), (28, -100.0)))


@pytest.fixture(scope="module")
def plain(target, contexts) -> PlainDecoder:
    return PlainDecoder(target, contexts(target, n_ctx=N_CTX, n_batch=512, n_seq_max=1))


@pytest.fixture(scope="module")
def decoders(target, draft, contexts):
    shape = SHAPES[16]
    return {
        "draft tree": SpeculativeDecoder(target, contexts(target, n_ctx=N_CTX, n_batch=512),
                                         TreeGrower(draft, contexts(draft, n_ctx=N_CTX, n_batch=64), shape), shape),
        "lookup": lookup_decoder(target, contexts, 64),
        "hybrid": hybrid_decoder(target, draft, contexts, 64),
    }


@pytest.fixture(scope="module")
def grammar(target):
    return Grammar.from_schema(target, SCHEMA)


def run(decoder, prompt, params, n=TOKENS, seed=0):
    tokens, logprobs = [], []
    for step in decoder.steps(prompt, params, n, make_rng(seed)):
        tokens.extend(step.tokens)
        logprobs.extend(step.logprobs or ())
    return tokens, logprobs


def answer_json(model, tokens) -> object:
    return json.loads(model.detokenize([t for t in tokens if not model.is_eog(t)]))


@pytest.mark.parametrize("kind", ["draft tree", "lookup", "hybrid"])
def test_json_schema_greedy_equals_plain_constrained_decoding(kind, target, plain, decoders, grammar):
    params = SamplingParams(grammar=grammar, logprobs=2)
    spec = decoders[kind]
    forced = 0
    for text in SCHEMA_PROMPTS if kind == "draft tree" else SCHEMA_PROMPTS[:1]:
        prompt = chat_prompt(target, text)
        expected, expected_lp = run(plain, prompt, params, n=64)
        out, out_lp = run(spec, prompt, params, n=64)
        assert out == expected, f"{kind}, {text!r}: {target.detokenize(out)!r} vs plain {target.detokenize(expected)!r}"
        assert expected[-1] in plain.eog, "the answer should be complete within the token limit"
        jsonschema.validate(answer_json(target, out), SCHEMA)
        # Log-probs of the same tokens agree up to float noise: a tree batch and a one-token pass sum
        # in different orders (differences of a few 1e-3 measured on this model).
        assert [lp.token for lp in out_lp] == out
        np.testing.assert_allclose([lp.logprob for lp in out_lp], [lp.logprob for lp in expected_lp], rtol=1e-3, atol=1e-2)
        forced += spec.stats.as_dict()["forced_tokens"]
    assert forced > 0, "a schema's fixed keys should be verified as free forced drafts"


@pytest.mark.parametrize("kind", ["draft tree", "lookup", "hybrid"])
def test_penalties_and_logit_bias_greedy_equal_plain_decoding(kind, target, plain, decoders):
    spec = decoders[kind]
    for text in FREE_PROMPTS if kind == "draft tree" else FREE_PROMPTS[:1]:
        prompt = chat_prompt(target, text)
        expected, _ = run(plain, prompt, PENALISED)
        unpenalised, _ = run(plain, prompt, SamplingParams())
        assert expected != unpenalised, "the penalties should change this answer (else the test shows nothing)"
        assert 28 not in expected, "a -100 bias bans the token"
        out, _ = run(spec, prompt, PENALISED)
        assert out == expected, f"{kind}, {text!r}: {target.detokenize(out)!r} vs plain {target.detokenize(expected)!r}"


def test_logprobs_with_and_without_speculation(target, plain, decoders):
    params = SamplingParams(logprobs=3)
    prompt = chat_prompt(target, FREE_PROMPTS[1])
    expected, expected_lp = run(plain, prompt, params)
    out, out_lp = run(decoders["draft tree"], prompt, params)
    assert out == expected and len(out_lp) == len(out)
    assert decoders["draft tree"].stats.as_dict()["draft_tokens"] > 0, "the tree should have been used"
    np.testing.assert_allclose([lp.logprob for lp in out_lp], [lp.logprob for lp in expected_lp], rtol=1e-3, atol=1e-2)
    for a, b in zip(out_lp, expected_lp):
        assert [t for t, _ in a.top] == [t for t, _ in b.top] and a.top[0][0] == a.token  # greedy: the best
        assert all(lp <= 0 for _, lp in a.top)


SAMPLES = 800
SAMPLING_SHAPE = TreeShape(budget=6, depth=2, width=2, top_k=3)


@pytest.mark.slow
def test_sampled_penalised_constrained_tokens_have_plain_distribution(offline_models, load_model, contexts):
    """Chi-square on the tiny random model as its own draft: 4 sampled tokens under penalties and a
    grammar, through trees, follow plain sampling's distribution."""
    from scipy.stats import chi2_contingency

    tiny = load_model(offline_models.smollm2_random)
    plain = PlainDecoder(tiny, contexts(tiny, n_ctx=256, n_batch=64, n_seq_max=1, threads=TINY_THREADS))
    spec = SpeculativeDecoder(tiny, contexts(tiny, n_ctx=256, n_batch=64, threads=TINY_THREADS),
                              TreeGrower(tiny, contexts(tiny, n_ctx=256, n_batch=64, threads=TINY_THREADS), SAMPLING_SHAPE),
                              SAMPLING_SHAPE)
    # A grammar with choices at every token and a fixed run in the middle.
    grammar = Grammar.from_text(tiny, 'root ::= [a-z]+ " is " [a-z ]+')
    params = replace(PENALISED, temperature=1.0, top_k=8, grammar=grammar)
    prompt = chat_prompt(tiny, "Hi")
    t0 = time.perf_counter()
    plain_samples = [first_tokens(plain, prompt, params, make_rng(i)) for i in range(SAMPLES)]
    spec_samples, accepted = [], 0
    for i in range(SAMPLES):
        spec_samples.append(first_tokens(spec, prompt, params, make_rng(10_000 + i)))
        accepted += sum(s.accepted for s in spec.stats.steps)
    table = binned(plain_samples, spec_samples)
    p_value = chi2_contingency(table).pvalue
    print(f"\npenalties + grammar, T=1: {time.perf_counter() - t0:.1f} s, {table.shape[1]} bins, "
          f"{accepted / SAMPLES:.2f} tree tokens accepted per run, p = {p_value:.3g}")
    assert accepted > SAMPLES / 4
    assert table.shape[1] >= 10
    assert p_value >= 1e-3, f"speculative sampling differs from plain sampling (p = {p_value:.2g})\n{table}"


# Enough that sampling at 0.8 where 1.0 was asked fails (p = 4e-4; 800 samples: 2e-3).
PAST_SAMPLES = 1500


@pytest.mark.slow
def test_sampled_tokens_past_a_forced_run_have_plain_distribution(offline_models, load_model, contexts, monkeypatch):
    """Chi-square on the tiny random model: 8 sampled tokens under penalties and a grammar whose
    first choice is followed by a forced run, through lookup trees of 2 nodes. The forced run
    goes past lookup's tree; lookup reads on past the run's end (what earlier samples wrote after
    it) and those nodes are verified in the run's own pass: sampled as plain sampling samples."""
    from scipy.stats import chi2_contingency

    from specrun.decoding import speculative

    past = []  # per step with lookup's nodes past the run: how many of them the target accepted
    real = speculative.graft_after_forced

    def grafting(proposal, *args, **kwargs):
        out = real(proposal, *args, **kwargs)
        if out.after_forced_from is not None:
            counted, start = out.lookup_tokens, out.after_forced_from

            def lookup_tokens(nodes):
                past.append(sum(1 for n in nodes[1:] if n >= start))
                return counted(nodes)
            out.lookup_tokens = lookup_tokens
        return out

    monkeypatch.setattr(speculative, "graft_after_forced", grafting)
    tiny = load_model(offline_models.smollm2_random)
    plain = PlainDecoder(tiny, contexts(tiny, n_ctx=256, n_batch=64, n_seq_max=1, threads=TINY_THREADS))
    shape = TreeShape(budget=2, depth=8, width=1, top_k=1)
    drafter = LookupDrafter(2, adapt=False)  # lives through all runs: its index holds every sample
    spec = SpeculativeDecoder(tiny, contexts(tiny, n_ctx=256, n_batch=64, threads=TINY_THREADS), drafter, shape)
    grammar = Grammar.from_text(tiny, 'root ::= ("a" | "b" | "c") " is the answer, " [a-z]+')
    params = replace(PENALISED, temperature=1.0, top_k=4, grammar=grammar)
    prompt = chat_prompt(tiny, "Hi")

    def sample(decoder, rng):
        return tuple(t for step in decoder.steps(prompt, params, 8, rng) for t in step.tokens)

    plain_samples = [sample(plain, make_rng(i)) for i in range(PAST_SAMPLES)]
    spec_rng, spec_samples, forced = make_rng(10_000), [], 0
    for _ in range(PAST_SAMPLES):
        spec_samples.append(sample(spec, spec_rng))
        forced += spec.stats.as_dict()["forced_tokens"]
    table = binned(plain_samples, spec_samples)
    p_value = chi2_contingency(table).pvalue
    print(f"\npast a forced run, T=1: {table.shape[1]} bins, {forced / PAST_SAMPLES:.2f} forced tokens a run, lookup "
          f"past the run in {len(past)} steps, {sum(past) / PAST_SAMPLES:.2f} of its tokens accepted a run, p = {p_value:.3g}")
    assert forced > PAST_SAMPLES, "the run should go past lookup's 2-node trees as forced drafts"
    assert len(past) > PAST_SAMPLES / 2 and sum(past) > PAST_SAMPLES / 4, "lookup's nodes past the run should be verified and taken"
    assert table.shape[1] >= 10
    assert p_value >= 1e-3, f"sampling past a forced run differs from plain sampling (p = {p_value:.2g})\n{table}"


def test_unsupported_schema_and_bad_grammar_are_clear_errors(target):
    with pytest.raises(UsageError, match="dependentRequired"):
        Grammar.from_schema(target, {"type": "object", "dependentRequired": {"a": ["b"]}})
    with pytest.raises(UsageError, match="grammar"):
        Grammar.from_text(target, "root ::= ( unclosed")


# ---------------------------------------------------------------------------------------------
# The CLI: --json-schema, --grammar, --logprobs, and the same as --jsonl fields


def test_generate_json_schema_and_logprobs(cli, tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(SCHEMA))
    result = cli("generate", "--json-schema", str(schema), "--json", "--logprobs", "1", "-n", "64",
                 "Describe a person as JSON.")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert [e["id"] for e in out["logprobs"]] == out["token_ids"]
    assert all(len(e["top_logprobs"]) == 1 and e["logprob"] <= 0 for e in out["logprobs"])
    assert out["stats"]["forced_tokens"] > 0


def test_generate_jsonl_constraints_and_clear_errors(cli, tmp_path):
    grammar = tmp_path / "yes.gbnf"
    grammar.write_text('root ::= "yes" | "no"\n')
    lines = "\n".join([
        json.dumps({"prompt": "Is the sky blue?", "grammar": 'root ::= "yes" | "no"', "id": "g"}),
        json.dumps({"prompt": "Hi", "json_schema": {"type": "object", "dependentRequired": {"a": ["b"]}}, "id": "bad"}),
        json.dumps({"prompt": "Hi", "logit_bias": {"x": 1}, "id": "bias"}),
        json.dumps({"prompt": "Hi", "logit_bias": {"\u00b2": 1}, "id": "superscript"}),  # a digit to str.isdigit
        json.dumps({"prompt": "Hi", "json_schema": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                                    "$ref": "#/$defs/a"}, "id": "cycle"}),
        json.dumps({"prompt": "Hi", "json_schema": {"type": "object", "required": ["s"], "properties": {
            "s": {"type": "string", "pattern": "^(.{0,20}){20}$"}}}, "id": "pattern"}),
    ]) + "\n"
    result = cli("generate", "--jsonl", "-n", "8", "--no-spec", input=lines)
    assert result.exit_code == 0, result.output
    answers = {o["id"]: o for o in map(json.loads, result.stdout.splitlines())}
    assert answers["g"]["text"] in ("yes", "no")
    assert answers["bad"]["field"] == "json_schema" and "dependentRequired" in answers["bad"]["error"]
    assert answers["bias"]["field"] == "logit_bias" and answers["superscript"]["field"] == "logit_bias"
    # Grammars llguidance cannot follow: at their first step, or mid-answer; never a short "answer".
    assert "no answer can follow" in answers["cycle"]["error"] and "text" not in answers["cycle"]
    assert "too many expressions" in answers["pattern"]["error"] and "text" not in answers["pattern"]
    refused = cli("generate", "--logprobs", "2", "Hi")
    assert refused.exit_code == 2 and "--logprobs needs --json" in refused.output
    bad_file = cli("generate", "--grammar", str(tmp_path / "missing.gbnf"), "Hi")
    assert bad_file.exit_code == 2 and "cannot read --grammar file" in bad_file.output
    answer = cli("generate", "--grammar", str(grammar), "--raw", "-n", "4", "--no-spec", "Is the sky blue? Answer:")
    assert answer.exit_code == 0 and answer.stdout.strip() in ("yes", "no"), answer.output



SIBLINGS = ["Describe a person named Anna as JSON.", "Describe a person named Bert as JSON.",
            "Describe a person named Carla as JSON."]


def test_lookup_reads_past_a_forced_run_in_the_same_pass(target, plain, contexts, grammar):
    """Sibling records under one schema: after the first, a key's value often repeats an earlier
    record's. A grammar's forced run (the key) is certain before the pass, so lookup reads past
    its end and the value is verified in the run's own pass: the siblings take fewer passes (14
    each without, 9 with, lookup's own trees held to 2 nodes), and every answer is still plain
    decoding's."""
    params = SamplingParams(grammar=grammar)
    passes = {}
    for reads in (False, True):
        decoder = lookup_decoder(target, contexts, 2)  # (a fixed tree of 2 nodes below the root)
        decoder.reads_past_forced = reads
        passes[reads] = []
        for text in SIBLINGS:
            prompt = chat_prompt(target, text)
            out, _ = run(decoder, prompt, params, n=64)
            expected, _ = run(plain, prompt, params, n=64)
            assert out == expected, f"{text!r}: {target.detokenize(out)!r} vs plain {target.detokenize(expected)!r}"
            passes[reads].append(len(decoder.stats.steps))
    assert sum(passes[True][1:]) < sum(passes[False][1:]), passes
