"""Replay recorded greedy answers through the lookup drafter (or the hybrid leaning on lookup) with
a tuning profile's target cost curve: a policy change's effect on tokens/s over plain decoding in
a second, without running a model. Greedy output is the target's whatever is verified, so one
recording serves every policy; the seconds of each step come from the profile (its target curve
and per-pass overhead) plus the drafter's own Python time, measured.

    python scripts/replay_lookup.py record OUT.json [--tokens 160] [-- --target gemma3-270m-f32]
    python scripts/replay_lookup.py replay OUT.json --profile PROFILE.json [--batch] [--tokens 160]
                                                    [--drafter lookup|hybrid]

`record` decodes every prompt of bench's workloads (all eight per workload) plainly, each from an
empty cache, and stores prompt and answer tokens. `replay` feeds them to a fresh drafter per
prompt (as a fresh process), or to one drafter for a workload's prompts (`--batch`, as one
`--jsonl` run), with the speed guard as `generate` has it, and prints per workload the simulated
speedup over plain decoding and tokens per step, then each prompt's steps' tree sizes with -v.
`--drafter hybrid` leans on lookup with a draft model that would cost 4 ms a token to read the
text and proposes only wrong tokens: it shows whether the hybrid's lean steps match lookup
alone's (the draft's own gains are not simulated).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from specrun.core.tree import DraftTree
from specrun.decoding.drafters.best_first import GrownTree
from specrun.decoding.drafters.hybrid import HybridDrafter
from specrun.decoding.drafters.lookup import LookupDrafter
from specrun.decoding.pay.guard import SpeedGuard
from specrun.experiments.workloads import WORKLOADS
from specrun.runtime.trees import LOOKUP_SHAPE


def record(out: Path, tokens: int, extra: list[str]) -> None:
    from specrun.core.sampling import SamplingParams
    from specrun.decoding.plain import PlainDecoder
    from specrun.decoding.stream import token_ids
    from specrun.runtime.plan import RunOptions
    from specrun.runtime.runtime import Runtime

    target = extra[extra.index("--target") + 1] if "--target" in extra else None
    rows = []
    with Runtime(RunOptions(target=target, quiet=True, no_spec=True)) as rt:
        for name, texts in WORKLOADS.items():
            for i, text in enumerate(texts):
                rt.clear_contexts()  # and a fresh decoder: its record of the cache must match
                prompt = rt.tokenize_prompt(text, chat=True)
                answer = token_ids(PlainDecoder(rt.target, rt.target_ctx), prompt, SamplingParams(), tokens)
                rows.append({"workload": name, "i": i, "prompt": [int(t) for t in prompt],
                             "answer": [int(t) for t in answer]})
                print(f"{name}[{i}]: {len(prompt)} prompt tokens, {len(answer)} answer tokens", file=sys.stderr)
    out.write_text(json.dumps(rows))


class _WrongDraft:
    """A draft model that reads text at 4 ms a token and proposes tokens that never match."""

    def __init__(self):
        self.cached, self.calls, self.last_catch_up = 0, 0, (0, 0.0)

    def debt(self, committed, root) -> int:
        return len(committed) + 1 - self.cached

    def propose(self, committed, root, budget, depth):
        self.calls += 1
        caught = self.debt(committed, root)
        self.last_catch_up = (caught, 0.004 * caught)
        self.cached = len(committed) + 1
        n = max(1, min(budget, depth))
        return GrownTree(DraftTree.chain(root, [0] * n, -0.1 * np.arange(1, n + 1)), self.last_catch_up[1] + 0.01, 1)

    def commit(self, proposal, accepted_nodes) -> None:
        self.cached += len(accepted_nodes) - 1

    def reset(self) -> None:
        self.cached = 0


def _drafter(kind: str):
    if kind == "lookup":
        return LookupDrafter(LOOKUP_SHAPE.budget)
    return HybridDrafter(_WrongDraft(), 5, LOOKUP_SHAPE.budget, catch_up_s=0.004)


def _walk(tree: DraftTree, tokens) -> int:
    node, accepted = 0, 0
    for token in tokens:
        node = tree.find_child(node, int(token))
        if node is None:
            break
        accepted += 1
    return accepted


def replay_one(drafter, prompt: list[int], answer: list[int], profile: dict, max_tokens: int) -> tuple[float, float, list[int]]:
    """Return (seconds, plain decoding's seconds, tree nodes per step) for one answer."""
    curve = profile["curves"]["target"]
    sizes, seconds = np.array(curve["sizes"], float), np.array(curve["seconds"], float)
    cost = lambda n: float(np.interp(n, sizes, seconds))
    per_pass, plain_overhead = profile["overhead_per_pass_s"], profile["plain"]["overhead_s"]
    guard = SpeedGuard(LOOKUP_SHAPE.budget)
    guard.new_request()
    if isinstance(drafter, HybridDrafter):
        drafter.start(len(prompt), max_tokens)
    committed, at, generated, total, nodes_each = list(prompt), 0, 1, 0.0, []
    while generated < max_tokens and at < len(answer) - 1:
        depth = min(LOOKUP_SHAPE.depth, max_tokens - generated - 1)
        budget = 0 if guard.wants_plain_step() else min(LOOKUP_SHAPE.budget, guard.cap)
        started = time.perf_counter()
        proposal = drafter.propose(committed, answer[at], budget, depth) if depth >= 1 and budget >= 1 else None
        python_s = time.perf_counter() - started
        nodes = len(proposal.tree) - 1 if proposal is not None else 0
        accepted = _walk(proposal.tree, answer[at + 1 : at + 1 + depth]) if proposal is not None else 0
        draft_s = float(getattr(proposal, "draft_s", 0.0) or 0.0)
        target_s = cost(nodes + 1)
        step_s = target_s + (per_pass if nodes else plain_overhead) + python_s + draft_s
        emitted = min(accepted + 1, len(answer) - 1 - at)
        committed += answer[at : at + emitted]
        at += emitted
        generated += emitted
        total += step_s
        nodes_each.append(nodes)
        drafter.observe(SimpleNamespace(tree_nodes=nodes, target_s=target_s, total_s=step_s, draft_s=draft_s,
                                        tokens=answer[at - emitted + 1 : at + 1]))
        if len(nodes_each) > 1:
            guard.record(emitted, step_s, nodes)
    drafter.learn(committed + [answer[at]])
    return total, (generated - 1) * (cost(1) + plain_overhead), nodes_each


def replay(path: Path, profile_path: Path, batch: bool, max_tokens: int, kind: str, verbose: bool) -> None:
    rows, profile = json.loads(path.read_text()), json.loads(profile_path.read_text())
    for name in WORKLOADS:
        shared = _drafter(kind) if batch else None
        seconds = plain = steps = 0.0
        tokens = 0
        for row in (r for r in rows if r["workload"] == name):
            drafter = shared if batch else _drafter(kind)
            spent, plain_s, nodes = replay_one(drafter, row["prompt"], row["answer"], profile, max_tokens)
            seconds, plain, steps = seconds + spent, plain + plain_s, steps + len(nodes)
            tokens += min(len(row["answer"]), max_tokens)
            if verbose:
                print(f"  {name}[{row['i']}] x{plain_s / spent:.3f} {nodes}")
        print(f"{name:>8}: x{plain / seconds:.3f} plain (simulated), {tokens / max(steps, 1):.2f} tokens per step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("out", type=Path)
    rec.add_argument("--tokens", type=int, default=160)
    rec.add_argument("extra", nargs="*", help="`--target ALIAS` (after --)")
    rep = sub.add_parser("replay")
    rep.add_argument("recording", type=Path)
    rep.add_argument("--profile", type=Path, required=True, help="a profile made by `specrun tune` (JSON)")
    rep.add_argument("--batch", action="store_true")
    rep.add_argument("--tokens", type=int, default=160)
    rep.add_argument("--drafter", choices=("lookup", "hybrid"), default="lookup")
    rep.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    if args.command == "record":
        record(args.out, args.tokens, args.extra)
    else:
        replay(args.recording, args.profile, args.batch, args.tokens, args.drafter, args.verbose)


if __name__ == "__main__":
    main()
