"""Grammar-forced runs as free drafts: tokens per target pass with and without them, on JSON-schema
prompts (keys, braces and enums the schema fixes).

    python scripts/bench_forced.py [--tokens 160] [--rounds 2] [--lookup]

One process, the default pair (or --target/--draft), modes alternating per prompt: the speculative
decoder with forced drafts, then the same decoder with them switched off. Both emit exactly the
same tokens (checked). Prints per prompt and in total: target passes, tokens per pass, tokens/s.
Draft-model trees without lookup branches by default: lookup indexes each answer, so the second
mode would copy the first mode's answer from it (--lookup keeps them, for a look at that case).
"""

from __future__ import annotations

import argparse
import json

from specrun.core.sampling import SamplingParams, make_rng
from specrun.engine.grammar import Grammar
from specrun.runtime.plan import RunOptions
from specrun.runtime.runtime import Runtime

ADDRESS = {"type": "object", "properties": {"street": {"type": "string", "maxLength": 30},
                                            "city": {"type": "string", "maxLength": 20},
                                            "country": {"enum": ["France", "Germany", "Italy", "Spain"]}},
           "required": ["street", "city", "country"], "additionalProperties": False}
CASES = [
    ("Describe a person as JSON.", {
        "type": "object", "additionalProperties": False,
        "properties": {"first_name": {"type": "string", "maxLength": 16}, "last_name": {"type": "string", "maxLength": 16},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}, "address": ADDRESS,
                       "employment_status": {"enum": ["employed", "unemployed", "retired", "student"]}},
        "required": ["first_name", "last_name", "age", "address", "employment_status"]}),
    ("List two books as JSON.", {
        "type": "object", "additionalProperties": False, "required": ["books"],
        "properties": {"books": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "object", "additionalProperties": False, "required": ["title", "author", "publication_year"],
            "properties": {"title": {"type": "string", "maxLength": 24}, "author": {"type": "string", "maxLength": 20},
                           "publication_year": {"type": "integer"}}}}}}),
    ("Give the weather report for Paris as JSON.", {
        "type": "object", "additionalProperties": False,
        "required": ["location", "temperature_celsius", "conditions", "wind_speed_kmh", "humidity_percent"],
        "properties": {"location": {"type": "string", "maxLength": 20}, "temperature_celsius": {"type": "integer"},
                       "conditions": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
                       "wind_speed_kmh": {"type": "integer"}, "humidity_percent": {"type": "integer"}}}),
]


def run(rt: Runtime, prompt: list[int], params: SamplingParams, n: int, forced: bool):
    rt.decoder.forced_drafts = forced
    rt.reset_cache()  # each mode prefills the prompt itself
    tokens: list[int] = []
    for step in rt.decoder.steps(prompt, params, n, make_rng(0)):
        tokens.extend(step.tokens)
    stats = rt.decoder.stats
    return tokens, stats.n_passes, stats.decode_s, int(stats.total("forced_tokens"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("--lookup", action="store_true")
    args = parser.parse_args()
    opts = RunOptions(target=args.target, draft=args.draft, ctx_size=2048, lookup=True if args.lookup else False)
    with Runtime(opts) as rt:
        if not rt.speculative:
            raise SystemExit("needs a speculative pair")
        totals = {True: [0, 0, 0.0], False: [0, 0, 0.0]}
        print(f"target {rt.models.target_name}, draft {rt.models.draft_name}, drafter {rt.plan.drafter}, "
              f"{rt.plan.tree.describe()}")
        for text, schema in CASES:
            prompt = rt.tokenize_prompt(text)
            params = SamplingParams(grammar=Grammar.from_schema(rt.target, schema))
            for _ in range(args.rounds):
                outs = {}
                for forced in (True, False):  # alternating, so load changes hit both modes alike
                    tokens, passes, seconds, n_forced = run(rt, prompt, params, args.tokens, forced)
                    outs[forced] = tokens
                    totals[forced][0] += len(tokens)
                    totals[forced][1] += passes
                    totals[forced][2] += seconds
                    label = "forced drafts" if forced else "drafter only "
                    print(f"  {text[:34]:34s} {label}: {len(tokens):3d} tokens, {passes:3d} passes, "
                          f"{len(tokens) / passes:.2f} tokens/pass, {len(tokens) / seconds:.1f} tok/s, "
                          f"{n_forced} forced tokens accepted")
                assert outs[True] == outs[False], "forced drafts changed the output"
                json.loads(rt.target.detokenize([t for t in outs[True] if not rt.target.is_eog(t)]))
        for forced in (True, False):
            n, passes, seconds = totals[forced]
            print(f"{'with' if forced else 'without'} forced drafts: {n / passes:.2f} tokens per target pass, "
                  f"{n / seconds:.1f} tok/s")
        ratio = (totals[True][0] / totals[True][1]) / (totals[False][0] / totals[False][1])
        speed = (totals[True][0] / totals[True][2]) / (totals[False][0] / totals[False][2])
        print(f"ratio: {ratio:.2f}x tokens per pass, {speed:.2f}x tokens/s")


if __name__ == "__main__":
    main()
