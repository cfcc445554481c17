"""How often the target takes the draft model's children, by the draft's own probability: the
correction best-first trees (drafters.best_first) score their nodes by. An estimate that decides
nothing: what is accepted is the target's own choice."""

from __future__ import annotations

import numpy as np

from specrun.decoding.adaptive import decay

# DraftCalibration: the draft's probabilities are corrected per tenth of [0, 1], recent proposals
# weighing most (half weight after CALIBRATION_HALF_LIFE children judged), each tenth starting
# from CALIBRATION_PRIOR proposals that went as the draft said; no chance above MAX_CHANCE (a
# child always scores below its parent, and no path is taken for certain).
CALIBRATION_BINS = 10
CALIBRATION_HALF_LIFE = 512
CALIBRATION_PRIOR = 4.0
MAX_CHANCE = 0.99


class DraftCalibration:
    """The chance that the target takes a child the draft model proposed, from the draft's own
    probability for it and whether it was the draft's first choice there, as this run measured.

    Best-first trees (SpecExec) keep the nodes whose paths the draft finds likeliest, which is
    the best tree where the draft's probabilities are the target's chances. A draft quantized
    from its target is far surer than it says: the demo pair's chains of 8 were accepted whole at
    most steps, where the draft gave its first choices 0.5-0.9 each, so its 16-node trees spent
    their nodes on second choices 7-11 deep and accepted less than the chain of 8 (4-10 tokens,
    against 8 at most steps). Corrected, a tree grows as deep as the draft is right and branches
    where it is not, as Sequoia's trees do from measured acceptance by rank.

    Per tenth of the draft's probability and per kind (first choice, other), a correction factor:
    the children the target took there over the chances the draft gave them (a tenth little judged
    leaning on its kind's factor over all tenths). A child's chance is
    its probability times the factor, interpolated between tenths (so the draft's order within a
    tenth stays), at most MAX_CHANCE. Before anything is judged it is the draft's probability.
    Only the order of nodes follows from it: what is accepted is the target's own choice."""

    def __init__(self, half_life: float = CALIBRATION_HALF_LIFE):
        self.keep = decay(half_life)
        mid = (np.arange(CALIBRATION_BINS) + 0.5) / CALIBRATION_BINS
        self._prior = CALIBRATION_PRIOR * mid
        self._taken = np.zeros((2, CALIBRATION_BINS))  # [first choice or not, tenth]
        self._chance = np.zeros((2, CALIBRATION_BINS))  # the draft's probabilities summed
        self._judged = np.zeros(2)  # children judged [first choice or not]
        self._mid = mid

    def judge(self, logps, first, taken) -> None:
        """Note children the target has chosen among: each one's log-prob as the draft gave it,
        whether it was the draft's first choice there, and whether the target took it."""
        q = np.exp(np.asarray(logps, np.float64))
        if not len(q):
            return
        kinds = np.where(np.asarray(first, bool), 0, 1)
        bins = np.minimum((q * CALIBRATION_BINS).astype(np.int64), CALIBRATION_BINS - 1)
        keep = self.keep ** len(q)
        self._taken *= keep
        self._chance *= keep
        self._judged *= keep
        np.add.at(self._taken, (kinds, bins), np.asarray(taken, np.float64))
        np.add.at(self._chance, (kinds, bins), q)
        np.add.at(self._judged, kinds, 1.0)

    def first_choices(self) -> tuple[float, float]:
        """(how many of the draft's first choices were judged, the share the target took;
        recent ones weighing most)."""
        judged = float(self._judged[0])
        return judged, float(self._taken[0].sum()) / judged if judged else 0.0

    def factors(self) -> np.ndarray:
        """[first choice or not, tenth]: the target's choices over the draft's chances; a tenth
        little judged leans on its kind's factor over all tenths (1 before anything is judged)."""
        overall = (self._taken.sum(axis=1, keepdims=True) + CALIBRATION_PRIOR) \
            / (self._chance.sum(axis=1, keepdims=True) + CALIBRATION_PRIOR)
        return (self._taken + self._prior * overall) / (self._chance + self._prior)

    def scores(self, logps: np.ndarray) -> np.ndarray:
        """Log-chances for rows of children best first (column 0: the draft's first choice), as
        from `sampling.log_softmax_topk`."""
        logps = np.asarray(logps, np.float64)
        q = np.exp(logps)
        factors = self.factors()
        scale = np.empty_like(q)
        scale[:, :1] = np.interp(q[:, :1], self._mid, factors[0])
        scale[:, 1:] = np.interp(q[:, 1:], self._mid, factors[1])
        return np.log(np.clip(q * scale, 1e-12, MAX_CHANCE))
