"""The rules by which specrun decides that speculation pays, and their thresholds.

Every decision that weighs a tree against plain decoding (or one tree against another) asks here,
at one of four moments, and every threshold is below with the measurement it came from:

- `specrun tune` predicts (`predicted_pays`), checks the prediction on held-out prompts, which
  overrules it either way (`check_keeps`), weighs the tuned tree against the untuned default
  (`default_wins`) and, per workload, the tuned default against the untuned one (`lost_to`);
- a plan made from a profile is checked at load (`profile_holds`);
- without a profile, the hybrid decides at load whether the draft model could pay at all
  (`draft_could_pay`) and, until it has run it, what to assume of it (`assumed_prior`);
- each step, a drafter sizes its tree by what its hindsight says pays (`best_size`; lookup trees
  by `best_lookup_size`, which tries the prior's price while few tree passes were timed), the hybrid
  weighs its draft model against leaning on lookup (`faster`, and the figures of its section
  below), and the speed guard (pay.guard) cuts what measures slower than plain steps, with the
  GUARD_ figures; over RPC workers the decoder fills a tree to a token count its passes have
  met (`fill_pays`).

Pure: callers hand in what was measured or predicted. The estimators the rules read decide
nothing themselves: decoding.adaptive (hindsight acceptance, the target's cost online),
tuning.cost_model (predictions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from specrun.decoding.adaptive import DraftPrior, Hindsight, TargetCost

# -- each step --------------------------------------------------------------------------------

# A tree a step proposes (a lookup tree, lookup branches grafted on the draft's tree, the draft's
# tree against leaning on lookup) must be expected this much faster than what it replaces to be
# verified: a bet that only breaks even on estimates loses to their noise.
STEP_MARGIN = 0.05

# The speed guard (pay.guard) judges every GUARD_WINDOW speculative steps; speculation slower than
# plain steps by more than GUARD_MARGIN halves the tree. A plain step measures plain decoding every
# GUARD_PROBE_EVERY steps; GUARD_RETRY_AFTER steps at a cut cap try twice the cap again, and a new
# request grows a cut cap GUARD_RECOVER-fold. Run-to-run noise of a step's seconds on the 2-core
# test host is a few percent; 16 steps average it to about 1%.
GUARD_WINDOW = 16
GUARD_MARGIN = 0.03
GUARD_PROBE_EVERY = 128
GUARD_RETRY_AFTER = 256
GUARD_RECOVER = 4

# Without a profile, what the hybrid assumes of the draft model until it has run (assumed_prior):
# its steps emit this many times plain decoding's tokens per second (a modest draft's gain),
# accepting this many draft tokens a pass.
ASSUMED_SPEEDUP = 1.3
ASSUMED_ACCEPTED = 1.0

# -- trees grown online (drafters.growing): how large the draft model's tree grows -------------

# A size is judged on at least this many proposals grown that large (recent ones weighing most):
# one step's acceptance is chance.
GROW_EVIDENCE = 3.0
# A size not yet judged is grown (explored: the step still verifies the size that pays) on every
# this many drafting steps while it promises to pay. Exploring costs only the larger tree's
# draft passes: what its best cut would have accepted is learned from the tokens the target emits.
EXPLORE_EVERY = 2
# While a size has not been grown, what its tree would accept is hoped to be what the size below
# it accepted plus, per doubling, what that one gained over half its size, times this: an
# optimist's guess (gains shrink as a tree doubles), which only decides whether to grow the larger
# tree once to find out; what it then measures decides whether it is verified.
GROWTH_HOPE = 1.0


# Where the draft grows its trees during the target's pass (a network), sizes up to
# tree_shapes.LONGEST_NETWORK_CHAIN are grown as chains while the target takes at least this share
# of the draft's first choices (judged on at least CHAIN_EVIDENCE of them): a chain accepted whole
# was drafted on during the pass, and the next step's is mostly drafted already. The demo pair
# (a draft quantized from its target) 50 ms away, chat: the target took 0.95 of them; chains of 16
# and 32 ran at 52-54 tokens/s, 16- and 32-node trees at 36 and 27, the chain of 8 at 49. A draft
# right 80% of the time gains more from a tree's second choices (test_growing's scripted text).
CHAIN_SHARE = 0.9
CHAIN_EVIDENCE = 32.0


def grows_chains(first_choices: tuple[float, float]) -> bool:
    """Whether grown sizes up to the longest network chain are chains, from (how many of the draft's
    first choices were judged, the share the target took)."""
    judged, share = first_choices
    return judged >= CHAIN_EVIDENCE and share >= CHAIN_SHARE


def grow_pays(rates, weights, current: int) -> int:
    """The index of the size a grown tree verifies next: the size with the most tokens per second
    among those judged on GROW_EVIDENCE proposals, moving from `current` only to one faster by
    STEP_MARGIN (noise must not make the tree jump between sizes)."""
    rates, judged = np.asarray(rates, np.float64), np.asarray(weights) >= GROW_EVIDENCE
    judged[current] = True
    best = int(np.argmax(np.where(judged, rates, -np.inf)))
    return best if best == current or faster(rates[best], rates[current]) else current


def hoped_accepted(accepted_here: float, accepted_half: float, doublings: float, depth: int) -> float:
    """What a tree `doublings` times twice as large is hoped to accept (GROWTH_HOPE), at most its depth."""
    gain = GROWTH_HOPE * max(0.0, accepted_here - accepted_half) * doublings
    return min(float(depth), accepted_here + gain)


# Nodes of lookup's tree past a grammar's forced run (a value after a JSON key that earlier text
# continued), verified in the same pass as the run: at most this many, where the run's end
# matches earlier text at STRONG_ORDER tokens or more (drafters.lookup.SessionText.propose_after).
AFTER_FORCED_NODES = 4


# -- the hybrid: when the draft model runs, and when lookup (or a plain step) carries the text --

# Steps leaning on lookup alone before the draft model runs again (to measure it again), when
# bringing it up costs no more than catching up this many tokens. Only where drafting could pay:
# its tree accepted whole would at least match leaning, for an answer's first such refresh, and
# beat it (`faster`) for the next ones. Each costs the draft's catch-up with what the lean steps
# emitted (a quarter of a plain step's time per token on the demo pair), which nothing pays back
# where even a whole chain loses: refreshing every 8 plain steps there ran free chat at 0.94x
# plain, and a refresh at the start of every answer cost sibling JSON records under a schema
# (lookup and the grammar's forced runs carrying them) 110 ms each, a tenth of their decoding.
# Where a whole chain would win, an answer's first chains may have been unlucky (1 to 3 of 5
# accepted, where 4.5 was the rule): one refresh an answer left such an answer leaning, at 0.93x.
LEAN_REFRESH = 8
REFRESH_DEBT = 16
# Drafting steps measured before the hybrid leans on plain steps (lookup proposing nothing): one
# step's acceptance is chance (a chat answer's first chain accepted 2 of 5, where 4.5 was the rule).
MIN_DRAFTED = 3
# A kind of lookup proposal (HindsightByKind) whose record has watched fewer proposals than this
# is priced by what lookup alone would have made of the steps that drafted, where that is faster
# (the hybrid's _lean_record): about where its DOUBT has faded to half (adaptive.KIND_HALF_LIFE).
THIN_KIND = 8
# An answer that has outlived the session's typical length is expected to go on at least this long.
MIN_AHEAD = 16
# Before this process has run the draft model, a catch-up dearer than what drafting would save
# over this many steps waits that many steps: lookup watches meanwhile (for free) whether the
# answer copies the text, and then decides (the hybrid's _lean_by_prior).
DEFER_STEPS = 4
# Without a profile, the first steps assume of the draft model what `assumed_prior` says
# until it has run. With a profile or without, a catch-up of at most SHORT_DEBT tokens
# never waits: so short a text (a one-line question in its chat template, a new turn of a chat)
# gives lookup little to copy, and waiting would only cost the draft's gain on the first steps.
SHORT_DEBT = 64
# Steps after which a leaning step's tokens and seconds weigh half in what leaning is expected to
# make of the rest of an answer (the hybrid's _lean_by_prior).
LEAN_HALF_LIFE = 24

# -- tune -------------------------------------------------------------------------------------

# Below this predicted speedup over plain decoding the gain is within measurement noise and a
# misprediction would make decoding slower: the tuner stores plain decoding (lookup stays on).
PREDICTED_GAIN = 1.05
# A draft tree that measures slower than this against plain decoding on the held-out prompts is
# turned off (lookup stays on), whatever the prediction said; one that measures at least this
# fast stays, whatever the prediction said. The check decodes a few short answers, whose speed
# varies by several percent from run to run on a small machine: a tree that measured about level
# with plain decoding stays, and the run's own speed guard (which measures plain steps itself)
# cuts it where it loses, as it does without a profile. Turning it off on such a figure took the
# draft tree's gain on free text away from every later run.
CHECK_FLOOR = 0.90
# The held-out check also decodes what runs without a profile (the untuned chain); a tuned tree
# must not measure slower than it by more than this, or the default is what is stored.
DEFAULT_MARGIN = 0.03
# The tuned default may run a workload at most this much slower than the untuned default on the
# predicting half; slower, and the untuned default is stored instead (a false alarm costs only what
# the tuned tree would have gained; the untuned default is what runs without a profile anyway).
UNTUNED_MARGIN = 0.05

# -- load -------------------------------------------------------------------------------------

# How far the target's one-token pass at load may be from the tuning profile's (either way, as a
# fraction) before the profile's figures are set aside for the run. The pass timed at load and
# plain decoding's passes agree within about 5% in one state of a machine; a CPU in another power
# state is 15-50% off, and on the 2-core test host the demo pair's draft went from losing (10.8 ms
# target passes) to paying 1.1x (12 ms). Set aside, a run is the untuned default: never slower.
PROFILE_DRIFT = 0.08


def faster(rate: float, than: float, margin: float = STEP_MARGIN) -> bool:
    """Whether `rate` (tokens per second) beats `than` by `margin`."""
    return rate >= than * (1.0 + margin)


def lost_to(rate: float, than: float, margin: float) -> bool:
    """Whether `rate` fell behind `than` by more than `margin`."""
    return rate < than * (1.0 - margin)


@dataclass(frozen=True)
class Beside:
    """What the other requests decoding together put into the target passes a step shares with
    them, as they measured it lately (decoding.batching.Room.beside): tokens each pass, and
    tokens they emit from each."""

    tokens: float = 0.0
    emitted: float = 0.0


ALONE = Beside()
# Steps after which a request's step weighs half in what it is said to put into a shared pass
# (Beside): a request's kind of text (a copy, free chat) changes within a few dozen tokens.
POST_HALF_LIFE = 8


def best_size(hindsight: Hindsight, step_seconds: Callable[[np.ndarray], np.ndarray], budget: int,
              beside: Beside = ALONE, depth: int | None = None) -> int:
    """The budget (at most `budget`) with the most tokens per second by `hindsight`, a step that
    verifies n nodes taking `step_seconds(n)`; 0 (no tree) unless a tree beats it by STEP_MARGIN.
    `depth`: the deepest the step's tree may reach (Hindsight.best): at an answer's last tokens,
    lookup had verified trees of 26 nodes 6 deep, 48 ms for 7 tokens.

    Beside other requests (one budget across them, SpecExec's selection spread over requests):
    the rate is that of the shared pass, every request's tokens over its seconds, the pass
    holding the others' tokens too. A request's nodes then cost what they add to that pass
    (on a CPU, a pass's first extra token is dear and the next ones cheap, so a tree can pay
    beside others where it would not alone) and they slow every request's tokens, not only its
    own (so a tree that pays alone may not pay beside others). Each request answers what the
    others put in lately; as they do the same, the budget goes where acceptance is likeliest,
    down to plain steps for all where no tree pays for what it costs the pass."""
    best, _ = hindsight.best(lambda nodes: step_seconds(nodes + beside.tokens), STEP_MARGIN, beside.emitted, depth)
    return min(best, budget)


def best_lookup_size(hindsight: Hindsight, cost: TargetCost, overhead: float, budget: int,
                     beside: Beside = ALONE, depth: int | None = None) -> int:
    """`best_size` for lookup trees, a step costing the target's pass (`cost`, over the tree's nodes
    and its root) and `overhead` seconds beside it. While the run's figure for multi-token passes
    is unsettled (TargetCost.settled) and prices every tree out, the size the prior price picks
    is tried: a pass met at a busy moment would otherwise stop every lookup tree for the rest
    of the run, since trees not tried are never measured again."""
    best = best_size(hindsight, lambda nodes: cost(nodes + 1) + overhead, budget, beside, depth)
    if best or cost.settled:
        return best
    return best_size(hindsight, lambda nodes: cost.prior(nodes + 1) + overhead, budget, beside, depth)


def draft_could_pay(best_speedup: float | None) -> bool:
    """Whether the draft's tree, accepted whole, beats plain steps by STEP_MARGIN as timed at load
    (True when nothing was timed: a profile's figures decide)."""
    return best_speedup is None or best_speedup >= 1.0 + STEP_MARGIN


def assumed_prior(plain_s: float, catch_up_s: float) -> DraftPrior:
    """What to assume of a draft model that has not run yet in a process without a profile: this
    process's one-token pass and the draft's catch-up cost per token as measured, its gain
    ASSUMED_SPEEDUP with ASSUMED_ACCEPTED tokens a pass."""
    tokens = ASSUMED_ACCEPTED + 1.0
    return DraftPrior(plain_s=plain_s, tree_s=tokens * plain_s / ASSUMED_SPEEDUP, step_s=0.0,
                      catch_up_s=catch_up_s, accepted=ASSUMED_ACCEPTED)


def predicted_pays(speedup: float) -> bool:
    """Whether the tuner's predicted speedup over plain decoding is worth a tree."""
    return speedup >= PREDICTED_GAIN


def check_keeps(measured_speedup: float) -> bool:
    """Whether tune's held-out check keeps a draft tree that measured `measured_speedup` over plain
    decoding (turning off one predicted to gain, or keeping one predicted to lose)."""
    return measured_speedup >= CHECK_FLOOR


def default_wins(default_tokens_per_s: float, tuned_tokens_per_s: float) -> bool:
    """Whether the untuned default measured faster than the tuned tree by more than DEFAULT_MARGIN."""
    return default_tokens_per_s > tuned_tokens_per_s * (1.0 + DEFAULT_MARGIN)


def profile_holds(target_pass_s: float, profiled_s: float) -> bool:
    """Whether a one-token pass timed now is within PROFILE_DRIFT of the profile's, either way."""
    return abs(math.log(target_pass_s / profiled_s)) <= math.log1p(PROFILE_DRIFT)


# --- Trees over RPC workers (SpeculativeDecoder._network_shape) ----------------------------------

# A pass filled to a token count met before holds at most this many times its own tokens, and
# FILL_SLACK more, while the filler's price is not measured (the counts around it untimed), and
# always for a tree (its filler nodes are verified, and drawn where the target takes them).
FILL_FACTOR = 2
FILL_SLACK = 8
# Round trips a new count of tokens costs once (llama.cpp's RPC client asks the worker the size of
# each kind of matrix product of a new shape): the demo target 50 ms away, 544 ms against 138 for
# 6 tokens; 200 ms away, 2.04 s against 0.44.
NEW_COUNT_TRIPS = 4


def fill_pays(n_tokens: int, met_tokens: int, extra_s: float, network_s: float, spent_s: float = 0.0,
              priced: bool = False) -> bool:
    """Whether a pass over n_tokens, a count this process has not met, is filled to met_tokens.

    A new count costs NEW_COUNT_TRIPS round trips once; filler costs `extra_s` (the met count's
    pass above the count met below, as timed) on every pass that takes it: at most one round
    trip a pass, and, with `spent_s` (what filler already cost passes over n_tokens), no more in
    all than the new count would have: from there the count is met instead (a server's passes
    would otherwise pay for the filler for as long as it runs). Up to FILL_FACTOR times the
    pass's tokens, unless `priced`: `extra_s` was timed, and the filler is no tree's. (Four
    requests' chains 200 ms from their worker, 12 tokens, met a new count at 2.1 s where a
    timed 41-token pass cost 46 ms more than their own would.)"""
    return ((priced or met_tokens <= FILL_FACTOR * n_tokens + FILL_SLACK) and extra_s <= network_s
            and spent_s + extra_s <= NEW_COUNT_TRIPS * network_s)


# --- Requests decoding together (pay.together) ---------------------------------------------------

# Committed tokens of all requests decoding together in one measured turn of drafting with the
# draft model (its passes shared) or of leaning on what costs no model pass.
TOGETHER_WINDOW = 64
# Every this many turns for a count of requests, the mode that measured slower runs a turn again.
TOGETHER_RETRY = 8
# A turn ends after a quarter of its window where it runs below this share of the other mode's
# measured rate: over RPC workers 50 ms away four requests of the demo pair drafting made 54 tokens/s
# and leaning 25, and each leaning turn of a whole window cost as much as two drafting turns.
TOGETHER_LOSING = 0.5


def together_retry_every(retry: int, best: float, other: float) -> int:
    """Every how many turns the slower mode of requests decoding together runs a turn again:
    `retry`, and more where it measured far slower (`best` and `other`, tokens/s). A retry cut
    after a quarter window costs a quarter window's time times best/other - 1, so the interval
    grows with best/other to keep that near one part in 2 * `retry` of the time between retries:
    200 ms from a worker four requests drafted 54 tokens/s and leaned 9, and a retry every 8
    turns cost a sixth of their time."""
    return max(retry, int(retry * best / (2.0 * max(other, 1e-9))))


def leaning_loses(drafting: float, leaning_at_most: float) -> bool:
    """Whether requests decoding together skip measuring a turn leaning on what costs no model
    pass: at most `leaning_at_most` tokens/s (their steps' tokens without the draft model over
    their least pass, pay.together) is under TOGETHER_LOSING of the `drafting` rate measured.
    Over a network a pass costs about the same for 4 tokens or 40, and the first leaning turn of
    four requests 200 ms away (1 token each a 440 ms pass) cost as much as six drafting turns."""
    return leaning_at_most < TOGETHER_LOSING * drafting


def draft_together(target_on_gpu: bool) -> bool:
    """Whether requests decoding together may draft with the draft model beside one another (in
    turns measured against leaning: pay.together), or lean on what costs no model pass.

    Only where the target's passes run on a GPU, whose passes cost little more for more tokens.
    On a CPU they are compute-bound, and every tree node a request adds fills the one shared pass:
    measured on the demo pair (2-core CPU, `scripts/bench_parallel.py --clients 1,2,4,8 --requests
    2`, mixed 64-token requests, the two alternating, two rounds each), drafting beside other
    requests ran 57.6 tokens/s in all against 51.6 leaning with 2 clients, 44.8 against 53.2 with
    4 and 44.2 against 66.1 with 8; taking turns, 44.6 against 48.8, 48.9 against 53.8 and 51.3
    against 63.0 (the turns that measure drafting cost what it loses)."""
    return target_on_gpu


# Flash attention off suits one request on a CPU (tuning.attention's advice) where a tree's passes
# (8 and 16 tokens) cost at least ATTENTION_TREE_GAIN times more with it and a one-token pass at
# most ATTENTION_ONE_TOKEN_SLACK less: the demo target after 1,024 tokens on an AVX-512 host 2.4x
# and 3.0x (one token 1.3x), where agents' traces ran 1.1-2.1x faster without it; on the host of
# the 2026-11-27 table trees 1.4-1.5x, one token 5% cheaper with it (docs/benchmarks.md).
ATTENTION_TREE_GAIN = 1.2
ATTENTION_ONE_TOKEN_SLACK = 1.05


# ...and only where the target's passes of several tokens round no further from its one-token passes
# without it than with it (greedy trees then verify as plain decoding alike): within
# ATTENTION_ROUNDING_SLACK times the largest logit difference with it, or ATTENTION_ROUNDING_FLOOR
# where that is none. Measured on the AVX-512 host (2026-11-30), 8 tokens after 8 in one pass against
# one a pass: the F32 demo target about 0.02 either way; its Q4_1 file 0 with it and 1.5 without
# (llama.cpp's attention products round the row otherwise, and the next layer's quantized
# activations carry that far: greedy answers parted from plain decoding in 8 of 9 prompts).
ATTENTION_ROUNDING_SLACK = 2.0
ATTENTION_ROUNDING_FLOOR = 1e-3


def attention_off_rounds_alike(with_diff: float, without_diff: float) -> bool:
    """Whether passes without flash attention round (`without_diff`, the largest logit difference
    from one-token passes) as near plain decoding as with it (`with_diff`)."""
    return without_diff <= max(ATTENTION_ROUNDING_SLACK * with_diff, ATTENTION_ROUNDING_FLOOR)


def attention_off_pays(ratios: dict[int, float]) -> bool:
    """Whether `ratios` (a pass of n tokens with flash attention over its time without) advise it off."""
    trees = [r for n, r in ratios.items() if n > 1]
    return bool(trees) and min(trees) >= ATTENTION_TREE_GAIN and ratios.get(1, 1.0) * ATTENTION_ONE_TOKEN_SLACK >= 1.0
