"""Speculative decoding with draft trees: one target forward pass verifies a whole tree.

Per step: a drafter (drafters/base.py) proposes a tree below the pending token; the target scores root +
tree in ONE batch, each leaf a sequence of its own (tree.py's colours); the acceptance walk
(verify.py) keeps what the target itself draws; both KV caches keep the accepted path and drop
the rest. The committed prefix stays cached across steps, so nothing is ever prefilled twice.

A target with a recurrent state (a hybrid that llama.cpp can roll back) verifies chains instead:
the tree's best paths (at most `n_rs_seq` drafts, up to one per sequence of the context), each in
a sequence of its own; the accepted chain's rejected tail is rolled back in its own sequence, which
is exact because the same decode held the pending token and all of that chain before it.
"""

from __future__ import annotations

import functools
import time
from typing import Iterator, Sequence

import numpy as np

from specrun.core.rules import PathRules
from specrun.core.sampling import SamplingParams, choose_token, near_tie, near_tie_nats, token_logprobs
from specrun.core.tree import DraftTree
from specrun.core.tree_shapes import MAX_BUDGET, TreeShape, network_size
from specrun.core.verify import accept_path
from specrun.decoding.batching import Lane
from specrun.decoding.drafters.base import Drafter, Proposal
from specrun.decoding.kv import TILE_ROWS, CachedSequence, chains_exact
from specrun.decoding.lookup_index import cut, graft
from specrun.decoding.pay.guard import SpeedGuard
from specrun.decoding.pay.rules import AFTER_FORCED_NODES
from specrun.decoding.pay.counts import met_counts
from specrun.decoding.pay.steps import StepSizer
from specrun.decoding.pay.together import Together
from specrun.decoding.steps import GenerationStats, Step
from specrun.engine import Batch, Context, kv_quantized
from specrun.limits import MAX_SEQ


class SpeculativeDecoder:
    """Decodes with the target, proposing trees with the draft. Output is exactly the target's."""

    def __init__(self, target_model, target_ctx: Context, drafter: Drafter, shape: TreeShape, guard: SpeedGuard | None = None,
                 lane: Lane | None = None, together: Together | None = None):
        """`lane`: the request's share of the target's context when several requests decode
        together (decoding.batching); by default all of it. `together`: the turns those requests
        take drafting with the draft model or not (pay.together; shared by their decoders)."""
        if target_ctx.n_batch < min(shape.budget, MAX_BUDGET) + 1:
            raise ValueError(f"target n_batch {target_ctx.n_batch} cannot hold a tree of {shape.budget} nodes + root")
        lane = lane if lane is not None else Lane(target_ctx)
        self.chain_only = target_ctx.chains_only  # (module doc)
        self.n_chains = len(lane.seqs) if self.chain_only else 0
        if target_ctx.has_state and target_ctx.n_rs_seq < 1:
            raise ValueError(f"{target_model.path.name} cannot roll its recurrent state back: decode it plainly")
        self.model = target_model
        self.ctx = target_ctx
        self.tie_nats = near_tie_nats(target_ctx.model.offloaded)
        self.shape = shape
        self.lane = lane
        self.cache = CachedSequence(target_ctx, Batch(target_ctx.n_batch, 1), lane)
        self.tree_batch = Batch(target_ctx.n_batch, MAX_SEQ)
        self.one = Batch(1, 1)
        self.drafter = drafter
        drafter.attach(lane)
        self.eog = target_model.eog_tokens
        self.stats = GenerationStats()
        self._drafted = False
        # What each step proposes, at what size (decoding.pay): with a guard, the tree shrinks,
        # down to plain steps, while speculation is measured slower than plain decoding here.
        # Chains round as one-token passes where measured so (kv.chains_exact): on a batch-invariant
        # build, or where a quantized cache's attention reads cells one by one (a Q4_1 target's trees
        # then verify bit for bit, their first path laid first, docs/exactness.md).
        self.sizer = StepSizer(guard, together, chains_exact=not self.chain_only and chains_exact(target_ctx))
        # Where the target's attention runs on this CPU, a greedy step with the cache to itself
        # keeps its cells in position order as plain decoding's, its tree's first path laid first
        # and only what that path chose kept (verify.accept_path), even where its rows round otherwise:
        # a tree's other branches leave their holes after the text, not inside it, where the next
        # tokens would move every later row's sums (a Q4_1 target's trees of 8-32 nodes gave plain
        # decoding's answer in 9 of 9 prompts, 4-6 without; docs/exactness.md, "Cells in order").
        self.cells_in_order = not target_model.offloaded
        # Such a step reads its first path's rows only (accept_path's first_path), so its pass
        # holds that path alone: the rest of the tree would be computed for nothing (a lookup tree
        # of 32 nodes 22 deep cost a pass of 33 tokens for the 23 read, 1.5 ms a token here; the
        # demo pair's rewrites ran 1.11-1.20x faster without). Tests of tree passes turn it off.
        self.path_alone = True
        # Grammar-forced runs as free drafts (scripts/bench_forced.py turns this off to compare).
        self.forced_drafts = True
        # Lookup's tree past a forced run's end grafted there (off: the run alone, to compare).
        self.reads_past_forced = True
        # The drafter grows its tree on while the target's pass runs elsewhere (runtime sets it:
        # a target wholly on GPUs or RPC workers, its lane its own).
        self.overlap = False
        # Trees cut to the node counts of core.tree_shapes.NETWORK_SIZES, or filled to a count
        # met before (a target on RPC workers: _network_shape), and the seconds a pass spends on
        # the network, which prices filler against a new count.
        self.network_sizes = False
        self.network_s = 0.0

    def swap_drafting(self, other: SpeculativeDecoder) -> None:
        """Exchange what drafts (the drafter, its draft context and what it learned, the speed
        guards) with another idle decoder of the same target context: several requests decoding at
        once keep their lanes of the target's cache (decoding.batching), while the drafting that
        served the last request goes to the next, warm, whichever lane that one takes."""
        for name in ("drafter", "sizer"):
            mine, theirs = getattr(self, name), getattr(other, name)
            setattr(self, name, theirs)
            setattr(other, name, mine)
        self.drafter.attach(self.lane)
        other.drafter.attach(other.lane)

    def reset(self) -> None:
        """Forget both KV caches (after an interrupted step left them in an unknown state)."""
        self.cache.clear()
        self.drafter.reset()

    def steps(self, prompt: Sequence[int], params: SamplingParams, max_tokens: int, rng: np.random.Generator) -> Iterator[Step]:
        self.drafter.greedy = params.greedy
        self.drafter.start(len(prompt), max_tokens)
        self.sizer.start(params)
        yield from self._steps(prompt, params, max_tokens, rng)
        # The generation ended (not interrupted): a drafter that learns from the session's text
        # reads all of it, the last step's tokens included.
        text = [*prompt, *(t for step in self.stats.steps for t in step.tokens)]
        self.drafter.learn(text, complete=self.stats.finish_reason == "eog")

    def _steps(self, prompt: Sequence[int], params: SamplingParams, max_tokens: int, rng: np.random.Generator) -> Iterator[Step]:
        self.stats = stats = GenerationStats(n_prompt=len(prompt))
        self._drafted = False  # (a step of this generation ran the draft model: _observe)
        if max_tokens < 1:
            stats.finish_reason = "length"
            return
        if params.reproducible:
            self.cache.truncate(0)  # and plain steps below: see SamplingParams.reproducible
        # The new part of the prompt goes in as few batches as the batch grid allows (kv.py) and
        # the last row gives the first token, as in plain decoding: no pass of its own for it.
        # Where that prefill runs elsewhere, the draft model reads the prompt meanwhile.
        overlap = self.overlap and not params.reproducible  # (beside others: in a pass of the prompt's own)
        meanwhile = functools.partial(self.drafter.prepare, prompt) if overlap else None
        _, stats.n_prefilled, stats.prefill_s = self.cache.sync(prompt, include_last=True, exact=params.exact_prefill,
                                                                keep_row=True, meanwhile=meanwhile,
                                                                joins=self.cache.joins(params))
        t_start = time.perf_counter()
        rules = PathRules.of(params)
        step = _first_step(self.cache.logits, params, rng, rules, self.tie_nats)
        step.from_prompt = True
        pending = step.tokens[0]
        step.total_s = time.perf_counter() - t_start
        stats.steps.append(step)
        stats.n_generated, stats.decode_s = 1, step.total_s
        yield step
        if pending in self.eog:
            stats.finish_reason = "eog"
            return
        cache, shape = self.cache, self.shape
        while stats.n_generated < max_tokens:
            room = cache.room()
            if room < 1:
                stats.finish_reason = "context"
                return
            t_start = time.perf_counter()
            remaining = max_tokens - stats.n_generated
            # Never draft deeper than what may still be emitted, nor more nodes than fit the cache.
            depth = min(shape.depth, remaining - 1, room - 1)
            if self.ctx.has_state:
                depth = min(depth, self.ctx.n_rs_seq)
            budget = self.sizer.size(self.lane.budget(min(shape.budget, room - 1)), params)
            proposal = None
            if depth >= 1 and budget >= 1:
                # Beside other requests (their passes shared), only proposals that cost no model
                # pass, unless the step sizer says the draft model drafts (pay.together).
                propose = self.drafter.propose if self.sizer.model_drafts(self.lane, self.drafter) else self.drafter.propose_free
                self.drafter.beside = self.sizer.beside(self.lane)
                proposal = propose(cache.tokens, pending, budget, depth)
            # Where a grammar allows one continuation only, that run is a path of the tree: grafted
            # where the drafter's tree leaves it (free drafts), or the whole tree without a drafter's.
            # Not for a reproducible request: a run verified in one pass rounds as a tree does.
            drafts_forced = rules is not None and self.forced_drafts and not params.reproducible
            forced = rules.forced(min(remaining - 1, room - 1)) if drafts_forced else []
            only_forced = bool(forced) and proposal is None
            if forced:
                most = min(self.ctx.n_batch, room) - 1
                proposal = graft_forced(proposal, pending, forced, most, chain=self.chain_only,
                                        max_leaves=len(self.lane.seqs))
                # Past the run's end, what lookup finds there (a value after a key, JSON the
                # session or the memory wrote before): verified in the same pass.
                deeper = depth - len(forced)  # (depth: within what the answer has left)
                after = self.drafter.propose_after(cache.tokens, pending, forced, AFTER_FORCED_NODES, deeper) \
                    if deeper >= 1 and self.reads_past_forced else None
                if after is not None:
                    graft_after_forced(proposal, forced, after, most, chain=self.chain_only,
                                       max_leaves=len(self.lane.seqs))
            step = self._verify(proposal, pending, params, rng, remaining, rules, forced=only_forced, along=forced)
            step.total_s = time.perf_counter() - t_start
            step.shared = self.lane.shared
            stats.steps.append(step)
            stats.n_generated += len(step.tokens)
            stats.decode_s += step.total_s
            self._observe(step, first=len(stats.steps) == 2)
            yield step
            if step.tokens[-1] in self.eog:
                stats.finish_reason = "eog"
                return
            pending = step.tokens[-1]
        stats.finish_reason = "length"

    def _observe(self, step: Step, first: bool) -> None:
        """Let an adapting drafter and the step sizer see the step's measurements: only of passes
        this request had to itself. A pass shared with other requests (decoding.batching) times
        their tokens and their waits too, nothing of what this request's tree costs: fed to the
        drafters' cost curves as this request's tree's, they grew the demo pair's trees threefold
        for the same accepted tokens afterwards (40 tokens/s one request at a time, against 56).
        Its seconds over all the tokens it held are a point of the cost curve, though: what
        prices a tree beside others, where a request may never have a pass to itself.

        Over RPC workers the turns of requests decoding together (pay.together) are timed
        without one-offs: a pass over a count of tokens new to the process, and a request's first
        step that ran the draft model (it brought the draft up to the prompt, in series with the
        target's passes there). Timed with them, the demo pair's four requests 50 ms away measured
        drafting at 23 tokens/s against 18 leaning, where a drafting pass made 24 tokens in 0.4 s.
        (On a CPU a turn's window is timed whole, as measured there before.)"""
        first_draft = step.draft_s > 0 and not self._drafted and self.ctx.network_s > 0
        one_off = self.lane.new_count or first_draft
        self._drafted = self._drafted or step.draft_s > 0
        self.sizer.record_together(step, one_off)
        self.sizer.post(self.lane, step)
        if self.lane.shared > 1:
            self.drafter.observe_shared(self.lane.pass_tokens, self.lane.pass_s)
            return
        self.drafter.observe(step)
        # A generation's first step that ran the draft model also brought it up to the prompt
        # (its prefill): a one-off, like the target's prefill, not what a step costs. A first
        # step without one counts: left out, a plain step the speed guard asked for to measure
        # plain decoding measured nothing, and the next step was a plain one again.
        if not first or step.draft_s == 0:
            self.sizer.record(step)

    def _verify(self, proposal: Proposal | None, pending: int, params: SamplingParams, rng, remaining: int,
                rules: PathRules | None = None, forced: bool = False, along: Sequence[int] = ()) -> Step:
        """Score root + tree with one target pass, walk it, and keep the accepted path in the cache
        (`along`: a grammar's forced run, which a tree's first path follows)."""

        ctx, cache, batch, lane = self.ctx, self.cache, self.tree_batch, self.lane
        p0 = cache.n_cached
        if proposal is None:
            return self._plain_step(pending, params, rng, rules)
        if self.chain_only:
            return self._verify_chain(proposal, params, rng, remaining, rules, forced)
        # A leaf takes a sequence: a tree with more leaves than the lane has is verified in its
        # best part that fits them (the plan opens fewer sequences on a sliding-window target).
        # A reproducible request verifies the best path alone, in a pass of its own (pay.steps:
        # only where a chain's logits are plain decoding's), or a whole tree where the kernels
        # are batch invariant and the request has the cache to itself: there a tree's first path
        # (its nodes first in the batch: DraftTree.path_first) is scored with plain decoding's
        # logits bit for bit, and a greedy step keeps only what those rows chose (accept_path's first_path);
        # on this CPU a greedy step does so too, for its cells' order (cells_in_order).
        first_path = params.greedy and lane.gate is None and (self.sizer.chains_exact or self.cells_in_order)
        tree, kept = proposal.tree.with_leaves(1 if params.reproducible and not first_path else len(lane.seqs))
        if first_path:
            tree, order = tree.path_first(along, alone=self.path_alone)
            kept = kept[order]
            tiled = len(tree) >= TILE_ROWS and not kv_quantized(ctx.kv_type)
            if tiled and self.cells_in_order and not self.sizer.chains_exact:
                # An f16 cache's CPU attention takes a pass of TILE_ROWS tokens or more in tiles, a
                # row's cells grouped by place: its rows part from one-token passes' by far more (a
                # Q4_1 target's trees of 64 nodes gave 2 of 9 answers plain decoding's, of 32 9 of 9).
                tree, order = tree.first(TILE_ROWS - 2)
                kept = kept[order]
        n_drafted = len(tree)  # (nodes from here on are filler: network_shape)
        if self.network_sizes:
            ending = tree.max_depth + 1 >= remaining  # (the answer's last tokens: the tree reaches them)
            tree, kept = self._network_shape(tree, kept, min(cache.room(), self.ctx.n_batch), ending)
        layout = tree.colour_batch(len(lane.seqs))
        base = lane.base  # colour c is the lane's sequence base + c; colour 0 holds the committed text
        # Every colour must see the committed prefix: copy it into colours 1.. before the pass.
        if layout.n_colours > 1:
            cache.share_window()
        for colour in range(1, layout.n_colours):
            ctx.seq_cp(base, base + colour, -1, -1)
        if layout.n_colours == 1:
            batch.set_arrays(layout.tokens, p0 + layout.positions, base, True)
        else:
            seq_ids = layout.seq_ids if base == 0 else [[base + c for c in s] for s in layout.seq_ids]
            batch.set_tree(layout.tokens, p0 + layout.positions, seq_ids, True)
        # Where the pass runs elsewhere, the draft model grows its tree on meanwhile (drafter.extend).
        overlap = self.overlap and not params.reproducible and not forced
        meanwhile = self.drafter.extend if overlap else None
        logits = lane.run(batch, solo=params.reproducible, meanwhile=meanwhile)
        target_s = lane.pass_s  # llama.cpp's time, not the wait for other requests' batches
        acceptance = accept_path(tree, logits, params, rng, self.eog, max_tokens=remaining, rules=rules,
                                 tie_nats=self.tie_nats, first_path=first_path)
        keep_tree_path(lane, layout, acceptance.nodes, p0)
        cache.tokens.extend(int(tree.tokens[n]) for n in acceptance.nodes)
        nodes = [int(kept[n]) for n in acceptance.nodes if n < n_drafted]  # the accepted path in the drafter's ids
        child_ranks = _child_ranks(proposal.tree, nodes, acceptance.bonus if len(nodes) == len(acceptance.nodes) else None)
        if self.network_sizes and lane.shared == 1:  # (a shared pass's count is its gate's: PassGate._fill)
            met_counts(self.model).note(len(tree), target_s, tree=True)
        if not forced:  # a forced chain was not the drafter's: it follows the committed text itself
            self.drafter.commit(proposal, nodes)
        n_tokens = len(acceptance.tokens)
        step = Step(
            list(acceptance.tokens),
            target_s=target_s,
            draft_s=proposal.draft_s,
            tree_nodes=len(tree) - 1,
            tree_depth=tree.max_depth,
            tree_leaves=layout.n_colours if len(tree) > 1 else 0,
            draft_passes=proposal.draft_passes,
            reused_nodes=proposal.reused,
            path_ranks=proposal.path_ranks(nodes),
            child_ranks=child_ranks,
            accepted=len(acceptance.nodes) - 1,
            lookup_tokens=proposal.lookup_tokens(nodes),
            forced_tokens=proposal.forced_tokens(nodes),
            near_ties=acceptance.near_ties,
        )
        if params.logprobs is not None:  # token i was drawn from node i's row: no extra pass
            rows = logits[list(acceptance.nodes[:n_tokens])]
            step.logprobs = token_logprobs(rows, acceptance.tokens, params.logprobs)
        return step

    def _network_shape(self, tree: DraftTree, kept: np.ndarray, room: int, ending: bool = False) -> tuple[DraftTree, np.ndarray]:
        """The tree a target on RPC workers verifies: one of the token counts its passes have met
        in this process where one a little larger pays (filler nodes added below the best path),
        else cut to core.tree_shapes.NETWORK_SIZES.

        A pass over a count not met before costs round trips there (pay.counts): an answer's
        passes met a new count at every chain cut short by its end and every lookup graft. A
        count already met costs its compute only: pay.rules.fill_pays weighs the filler. Any tree
        is verified exactly (the target draws at every node it walks): filler the target happens
        to draw is emitted like any node. Beside other requests the pass holds the sum of their
        trees, which their gate fills (batching.PassGate._fill): no filler node here. A tree that
        reaches the answer's last tokens (`ending`) is filled beyond twice its size too: a
        6-node chain cut to an answer's last 7 tokens met a new count 200 ms from the worker
        (2.04 s against 0.44), where 26 filler nodes to the chain of 32's count cost about 50 ms."""
        met, n = met_counts(self.model), len(tree)
        up = met.fill_to(n, room, self.network_s, tree=True, ending=ending) if not self.lane.sharing else n
        if up > n:
            tree = tree.copy()
            path = tree.best_path()
            node, guess = path[-1], _repeat_guess([*self.cache.tokens, *(int(tree.tokens[i]) for i in path)], up - n)
            for token in guess:
                node = int(tree.add_children(node, [token], [tree.logps[node] - _FILLER_LOGP])[0])
            return tree, kept
        if n not in met.counts and network_size(n - 1) < n - 1:
            tree, first = tree.first(network_size(n - 1))
            kept = kept[first]
        return tree, kept

    def _verify_chain(self, proposal: Proposal, params: SamplingParams, rng, remaining: int,
                      rules: PathRules | None = None, forced: bool = False) -> Step:
        """Score the proposal's best paths as independent chains and keep the accepted one.

        Measured on hybrid models (Gated DeltaNet, short-conv): chains of equal length, one
        sequence each with the committed state copied in, score exactly; the accepted chain's
        sequence then rolls back exactly and becomes the committed one. A rollback in another
        sequence followed by a copy, or one inside a prefix shared by several sequences, is wrong.
        """
        ctx, cache, tree = self.ctx, self.cache, proposal.tree
        p0, main = cache.n_cached, cache.seq
        paths = best_chains(tree, min(self.n_chains, ctx.n_seq_max), ctx.n_rs_seq if ctx.has_state else len(tree))
        length = max(len(path) for path in paths)
        trie = DraftTree(int(tree.tokens[0]), capacity=len(paths) * length + 1)
        rows, owner = [0], [0]  # per trie node: its logits row in the batch, the chain it came from
        seqs = [main] + [s for s in self.lane.seqs if s != main][: len(paths) - 1]
        batch = self.tree_batch
        batch.clear()
        for c, (path, seq) in enumerate(zip(paths, seqs)):
            if seq != main:
                ctx.seq_cp(main, seq, -1, -1)
            # Equal lengths keep the recurrent memory's equal split in one ubatch: a short chain
            # repeats its last token (any token is a valid proposal: only target draws are kept).
            tokens = [int(tree.tokens[n]) for n in path] + [int(tree.tokens[path[-1]])] * (length - len(path))
            node = 0
            for depth, token in enumerate(tokens):
                batch.add(token, p0 + depth, [seq], True)
                if depth == 0:
                    continue
                child = trie.find_child(node, token)
                if child is None:
                    child = trie.add(node, token, 0.0)
                    rows.append(c * length + depth)
                    owner.append(c)
                node = child
        logits = self.lane.run(batch)[rows]  # row i: after trie node i
        target_s = self.lane.pass_s
        acceptance = accept_path(trie, logits, params, rng, self.eog, max_tokens=remaining, rules=rules,
                                 tie_nats=self.tie_nats)
        chosen = owner[acceptance.nodes[-1]]
        seq = seqs[chosen]
        if len(paths) > 1:
            self.lane.keep(seq)
        cache.seq = seq
        cache.tokens.extend(int(batch.tokens[chosen * length + d]) for d in range(length))
        # At most length - 1 drafts go, fewer than this decode held for the sequence: exact.
        cache.roll_back(p0 + len(acceptance.nodes), last_decode=length)
        path = paths[chosen]
        nodes = path[: min(len(acceptance.nodes), len(path))]  # the proposal's own node ids
        if not forced:  # a forced chain was not the drafter's: it follows the committed text itself
            self.drafter.commit(proposal, nodes)
        step = Step(
            list(acceptance.tokens),
            target_s=target_s,
            draft_s=proposal.draft_s,
            tree_nodes=len(paths) * length - 1,
            tree_depth=length - 1,
            tree_leaves=len(paths) if length > 1 else 0,
            draft_passes=proposal.draft_passes,
            reused_nodes=proposal.reused,
            path_ranks=proposal.path_ranks(nodes),
            child_ranks=_child_ranks(trie, acceptance.nodes, acceptance.bonus),
            accepted=len(acceptance.nodes) - 1,
            lookup_tokens=proposal.lookup_tokens(nodes),
            forced_tokens=proposal.forced_tokens(nodes),
            near_ties=acceptance.near_ties,
        )
        if params.logprobs is not None:  # the trie's rows are its node ids
            rows = logits[list(acceptance.nodes[: len(acceptance.tokens)])]
            step.logprobs = token_logprobs(rows, acceptance.tokens, params.logprobs)
        return step

    def _plain_step(self, pending: int, params: SamplingParams, rng, rules: PathRules | None = None) -> Step:
        """A step without a tree: the root alone, as plain decoding does it (and no dearer)."""
        cache = self.cache
        self.one.set_arrays([pending], [cache.n_cached], [cache.seq], True)
        # Where the pass runs elsewhere, a drafter that rests meanwhile reads what it has not read.
        reads = self.overlap and self.drafter.reads_while_resting and not params.reproducible
        meanwhile = self.drafter.extend if reads else None
        row = self.lane.run(self.one, solo=params.reproducible, meanwhile=meanwhile)[-1]
        target_s = self.lane.pass_s
        cache.tokens.append(pending)
        return _first_step(row, params, rng, rules, self.tie_nats, target_s=target_s)


def _first_step(row: np.ndarray, params: SamplingParams, rng, rules: PathRules | None, tie_nats: float,
                target_s: float = 0.0) -> Step:
    """Return a one-token step drawn from one logit row, as plain decoding draws it."""
    shaped = row if rules is None else rules.shape(row)
    token = choose_token(shaped, params, rng)
    if rules is not None:
        rules.accept(token)
    step = Step([token], target_s=target_s)
    if params.greedy and (tie := near_tie(shaped, token, nats=tie_nats)) is not None:
        step.near_ties = (tie,)
    if params.logprobs is not None:
        step.logprobs = token_logprobs(row, [token], params.logprobs)
    return step


# Filler nodes score this far below their parent (log-prob): the least likely nodes of a tree.
_FILLER_LOGP = 30.0


def _repeat_guess(text: Sequence[int], n: int) -> list[int]:
    """n tokens that may follow `text`: what followed the last earlier occurrence of its last
    token (filler where nothing better is known), the last token repeated for the rest."""
    last = text[-1]
    start = next((i + 1 for i in range(len(text) - 2, max(-1, len(text) - 4098), -1) if text[i] == last), len(text))
    guess = list(text[start: start + n])
    return guess + [last] * (n - len(guess))


def best_chains(tree: DraftTree, n_chains: int, max_drafts: int) -> list[list[int]]:
    """Return up to n_chains root-to-node paths (node ids) of at most max_drafts drafts each:
    the best path first, then the paths to the best-scored other leaves."""
    paths = [tree.best_path()[: max_drafts + 1]]
    if n_chains > 1 and len(tree) > 1:
        leaves = [int(n) for n in tree.leaves() if n != 0]
        leaves.sort(key=lambda n: (-tree.logps[n], n))
        for leaf in leaves:
            if len(paths) >= n_chains:
                break
            path = tree.path(leaf)[: max_drafts + 1]
            if all(path[: len(p)] != p and p[: len(path)] != path for p in paths):
                paths.append(path)
    return paths


def graft_forced(proposal: Proposal | None, pending: int, forced: list[int], max_nodes: int,
                 chain: bool = False, max_leaves: int = MAX_SEQ) -> Proposal:
    """Return the proposal with a grammar's forced run as a path from the root: the drafter's tree
    where it already holds the run, the rest appended below (new ids, past the drafter's own, so
    its `commit` is unaffected), within `max_nodes` nodes besides the root; with `chain`, only
    below the end of a chain. The run is appended to a copy: the drafter may still be following
    its own tree (adaptive.Hindsight sized its records by it), so that tree is never grown."""
    if proposal is None:
        return Proposal(DraftTree.chain(pending, forced[:max_nodes]), forced_from=1)
    tree, node = proposal.tree, 0
    for i, token in enumerate(forced):
        child = tree.find_child(node, token)
        if child is None:
            rest = forced[i: i + max_nodes - (len(tree) - 1)]
            branching = not tree.is_leaf(node)
            if not rest or (branching and (chain or len(tree.leaves()) >= max_leaves)):
                return proposal
            proposal.forced_from = len(tree)
            proposal.tree = tree = tree.copy()
            logp = float(tree.logps[node])
            for token in rest:
                node = tree.add(node, token, logp)
            return proposal
        node = child
    return proposal


def graft_after_forced(proposal: Proposal, forced: Sequence[int], after: DraftTree, max_nodes: int,
                       chain: bool = False, max_leaves: int = MAX_SEQ) -> Proposal:
    """Graft `after` (a tree below forced[-1]) at the end of the forced run's path in the
    proposal's tree (lookup_index.graft), its best nodes within `max_nodes` nodes besides the root
    and `max_leaves` leaves; with `chain`, no new leaf. As graft_forced: new ids past all others
    (`after_forced_from`), on a copy. Nothing where the path does not hold the whole run (it was
    cut to fit)."""
    tree, end = proposal.tree, 0
    for token in forced:
        end = tree.find_child(end, token)
        if end is None:
            return proposal
    room = max_nodes - (len(tree) - 1)
    if room < 1:
        return proposal
    tree = tree.copy()
    start = len(tree)
    graft(tree, cut(after, room), len(tree.leaves()) if chain else max_leaves, at=end)
    if len(tree) > start:
        proposal.tree, proposal.after_forced_from = tree, start
    return proposal


def keep_tree_path(lane: Lane, layout, nodes: Sequence[int], p0: int) -> None:
    """Leave exactly the committed prefix + the path `nodes` in the lane's first sequence (colour
    0); drop every other tree colour."""
    ctx, base = lane.ctx, lane.base
    end = p0 + len(nodes)
    colour = int(layout.first_colour[nodes[-1]])
    if colour == 0:
        ctx.seq_rm(base, end, -1)
    else:
        # The cells of colour c in [p0, end) are exactly the path down to the accepted node.
        ctx.seq_rm(base, p0, -1)
        ctx.seq_cp(base + colour, base, p0, end)
    if layout.n_colours > 1:
        lane.keep(base, used=layout.n_colours)


def _child_ranks(tree, nodes: list[int], bonus) -> tuple[int, ...]:
    """For each visited node of the drafter's `tree` (the accepted path `nodes`, in its ids, then a
    `bonus` token drawn past it, if any): 1 + position of the chosen child among its children, 0
    if none carried it. Read from the drafter's tree, the step's pass may have held only part of
    it (a first path alone): the child that carried the bonus is still known.

    Children are stored best-first and pruning keeps a prefix of them, so position = draft rank.
    """
    ranks = []
    for depth, node in enumerate(nodes):
        children = tree.children(node)
        if depth + 1 < len(nodes):
            ranks.append(children.index(nodes[depth + 1]) + 1)
        elif bonus is not None and children:
            child = tree.find_child(node, bonus)
            ranks.append(children.index(child) + 1 if child is not None else 0)
    return tuple(ranks)
