"""The one interface between the speculative decoder and whatever proposes its trees.

A drafter proposes a tree of candidate tokens below the pending token each step; the decoder
verifies it with one target pass and tells the drafter which path the target accepted. The
decoder never needs to know what the drafter is (a draft model growing best-first, a static
Sequoia template, n-gram lookup in the text so far, or a mix).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

from specrun.core.tree import DraftTree
from specrun.decoding.pay.rules import ALONE, Beside


@dataclass
class Proposal:
    """A proposed tree (node 0 is the pending root token) and what proposing it cost."""

    tree: DraftTree
    draft_s: float = 0.0  # seconds spent in draft-model forward passes
    draft_passes: int = 0
    lookup_from: int | None = None  # node ids >= this came from text lookup (None: none did)
    forced_from: int | None = None  # node ids >= this are a grammar's forced run, grafted by the decoder
    # Node ids >= this: lookup's continuation past the forced run's end, grafted by the decoder.
    after_forced_from: int | None = None
    reused: int = 0  # nodes taken from the tree the draft grew while the last target pass ran (no pass now)

    def lookup_tokens(self, nodes: Sequence[int]) -> int:
        """Return how many of the accepted nodes (root first) came from text lookup."""
        first, after = self.lookup_from, self.after_forced_from
        end = self.forced_from if self.forced_from is not None else after
        grafted = 0 if first is None else sum(1 for n in nodes[1:] if n >= first and (end is None or n < end))
        return grafted + (0 if after is None else sum(1 for n in nodes[1:] if n >= after))

    def forced_tokens(self, nodes: Sequence[int]) -> int:
        """Return how many of the accepted nodes (root first) a grammar forced (no drafter proposed them)."""
        first, end = self.forced_from, self.after_forced_from
        return 0 if first is None else sum(1 for n in nodes[1:] if n >= first and (end is None or n < end))

    def path_ranks(self, nodes: Sequence[int]) -> tuple[int, ...]:
        """Return calibration ranks of the accepted nodes (best-first drafters only; else empty)."""
        return ()


class Drafter(ABC):
    """Proposes trees for the speculative decoder and follows what the target accepted.

    Every drafter derives from this class. Its hooks beyond propose and commit do nothing here:
    a drafter overrides those it uses, and the decoder calls them all without asking which kind
    of drafter it holds.
    """

    # What the other requests decoding together put into the target pass this step shares with
    # them (the decoder sets it before each proposal): drafters that size their trees by what
    # pays (lookup, hybrid) weigh their nodes against that pass (pay.rules.best_size).
    beside: Beside = ALONE
    # Whether the generation under way is greedy (the decoder sets it as each one starts): a
    # greedy request's text that repeats earlier text goes on as it did (adaptive.REPEAT_MATCH).
    greedy: bool = False

    @abstractmethod
    def propose(self, committed: Sequence[int], root: int, budget: int, depth: int) -> Proposal | None:
        """Return a tree of at most `budget` nodes below `root`, at most `depth` deep (None: nothing
        to propose; the step then decodes the root alone). `committed` is the text in the
        target's cache, before the root."""

    @abstractmethod
    def commit(self, proposal: Proposal, accepted_nodes: Sequence[int]) -> None:
        """Take note that the target accepted the path `accepted_nodes` (root first) of `proposal`."""

    def propose_after(self, committed: Sequence[int], root: int, forced: Sequence[int], budget: int,
                      depth: int) -> DraftTree | None:
        """Return a tree below forced[-1] that continues committed + [root] + forced, at most
        `budget` nodes and `depth` deep, from what costs no model pass (a grammar's forced run is
        certain before the target's pass: lookup can read past it); None where there is none."""
        return None

    def propose_free(self, committed: Sequence[int], root: int, budget: int, depth: int) -> Proposal | None:
        """Return what `propose` would, where it costs no model pass; None (a plain step) where it
        would. A step whose target pass other requests share (decoding.batching) asks this: one
        request's draft passes hold up every other's pass (measured on the demo pair, 4 clients
        at once: draft-model trees 57 tokens/s in all, plain steps 74, one request at a time 87)."""
        return None

    # Whether `extend` has work beside a plain step's pass too (the hybrid's resting draft reads
    # the text): only then does the decoder run a plain step's pass beside it, in a thread.
    reads_while_resting = False

    def extend(self, done) -> None:
        """Grow the last proposal's tree on while the target's pass over it runs elsewhere (a GPU,
        an RPC worker), until `done` (a threading.Event) is set: what the next proposal may take
        from it (best_first.TreeGrower.extend). Called only where the decoder overlaps them."""

    def overlaps(self) -> None:
        """The decoder overlaps drafting with the target's passes (extend, prepare): a drafter
        that sizes its trees online may size for that (growing.GrowingTrees)."""

    def first_passes_apart(self) -> None:
        """The target's first pass over a count of tokens costs more than the next ones (RPC
        workers: llama.cpp asks the worker its products' sizes, a round trip each): a drafter that
        prices its trees by the target's passes keeps those first passes out of its curve
        (adaptive.TargetCost.set_first_passes_apart)."""

    def cost_step(self, step: int) -> None:
        """The target's passes of `step` tokens or more cost another regime (its layers in RAM run
        on a GPU of this machine after a copy: hardware.offload.cost_steps): a drafter that prices
        its trees by the target's passes prices those apart (adaptive.TargetCost.set_step)."""

    def prepare(self, text: Sequence[int], done) -> None:
        """Read `text` (a prompt) while the target prefills it elsewhere (a GPU, an RPC worker),
        until `done` (a threading.Event) is set: what the first proposal need not catch up with
        (best_first.TreeGrower.prepare). Called only where the decoder overlaps them."""

    def attach(self, lane) -> None:
        """Draft for the request that decodes in this lane of the target's context (a drafter
        changes hands between decoders: runtime.pool): draft passes shared with other requests'
        wait with that request's target passes (decoding.batching)."""

    @property
    def drafts_beside_others(self) -> bool:
        """Whether the drafter may run model passes while other requests decode beside its own
        (in turns measured against leaning: pay.together): where its passes go through the gate
        the others' draft passes go through (decoding.batching: one draft pass expands every
        request's tree), or are small passes of its own (MTP)."""
        return False

    def reset(self) -> None:
        """Forget any cached state (after an error left the caches in an unknown state)."""

    def start(self, n_prompt: int, max_tokens: int) -> None:
        """A generation of at most `max_tokens` begins after a prompt of `n_prompt` tokens (the
        hybrid plans over the whole answer)."""

    def observe(self, step) -> None:
        """See every Step the decoder made (its timings and tree size): drafters that adapt to
        what this run measures (lookup, hybrid) learn from it."""

    def observe_shared(self, n_tokens: int, seconds: float) -> None:
        """See a target pass this request shared with others (decoding.batching): `n_tokens` in
        all, every request's, in `seconds`. Nothing of what its own tree costs, but a point of the
        pass's cost curve, which prices a tree beside others (pay.rules.best_size)."""

    def learn(self, text: Sequence[int], complete: bool = True) -> None:
        """Take prompt + answer when a generation ends (`complete`: the model ended it, not a
        token limit): drafters that index the text (lookup) learn from it."""


class ModelDrafter(Drafter):
    """A drafter that runs a draft model (best_first.TreeGrower): what the hybrid asks of it
    besides proposing, namely how far its cache is behind the committed text and what catching
    up and its expansion passes cost."""

    last_catch_up: tuple[int, float] = (0, 0.0)  # (tokens, seconds) the last proposal's catch-up decoded
    last_passes: Sequence[tuple[int, float]] = ()  # (tokens, seconds) of the last proposal's expansion passes
    last_shared: bool = False  # whether a pass of the last proposal held other requests' trees too
    last_read: Sequence[tuple[int, float]] = ()  # (tokens, seconds) of the last read_ahead's passes

    @abstractmethod
    def debt(self, committed: Sequence[int], root: int) -> int:
        """Return how many tokens the draft's cache must decode before it can propose below root."""

    def probe(self) -> dict[int, float] | None:
        """Return the draft's pass seconds by batch size, timed now (None: cannot be timed)."""
        return None

    def read_ahead(self, text: Sequence[int], done, fits=None) -> None:
        """Read as much of `text` into the draft's cache as fits before `done` is set, in short
        passes of at most `fits()` tokens each (the target's pass runs elsewhere meanwhile:
        hybrid.HybridDrafter.extend)."""
