"""Token counts a model's passes have met in this process, and whether a pass is filled to one.

Over RPC workers a pass over a count of tokens not met before in the process costs round trips:
llama.cpp's RPC client asks the worker, one round trip each, the size of every kind of matrix
product of an output shape it has not met (ggml-rpc's alloc-size cache, kept per process). The
demo target 50 ms away: a 7-token pass took 640 ms the first time, 138 after; 200 ms away a
44-token prompt's pass 2.10 s, the same count's next pass 0.44. A tree verified there is cut to a
few node counts or filled to one met before (SpeculativeDecoder._network_shape), and so is a
prompt's pass (kv.CachedSequence.extend): a prompt's length is new nearly every request.
"""

from __future__ import annotations

from specrun.decoding.adaptive import Average
from specrun.decoding.pay.rules import fill_pays


class MetCounts:
    """The token counts one model's passes met in this process, and their passes' seconds after
    each count's first (a first pass asks the worker its shapes' sizes: no measure of the next)."""

    def __init__(self):
        self.counts: set[int] = {1}  # (a one-token pass is met when the context is made: llama.cpp reserves its graph)
        self._seconds: dict[int, Average] = {}

    def note(self, n_tokens: int, seconds: float) -> None:
        """A pass over n_tokens took `seconds`."""
        if n_tokens in self.counts:
            self._seconds.setdefault(n_tokens, Average(8)).add(seconds)
        self.counts.add(n_tokens)

    def gap(self, n_tokens: int, up: int) -> float:
        """Seconds a pass over `up` tokens is timed above one over the largest count met at most
        n_tokens (0 while either is untimed)."""
        below = max((m for m in self._seconds if m <= n_tokens), default=0)
        if not below or up not in self._seconds:
            return 0.0
        return float(self._seconds[up].mean) - float(self._seconds[below].mean)

    def fill_to(self, n_tokens: int, most: int, network_s: float) -> int:
        """The count a pass over n_tokens holds: n_tokens where it was met (or no met count up to
        `most` pays, pay.rules.fill_pays), else the least met count above it."""
        if n_tokens in self.counts:
            return n_tokens
        up = min((m for m in self.counts if m > n_tokens), default=0)
        if 0 < up <= most and fill_pays(n_tokens, up, self.gap(n_tokens, up), network_s):
            return up
        return n_tokens


# Per model file: ggml-rpc's cache outlives a model loaded again in the same process.
_MET: dict[str, MetCounts] = {}


def met_counts(model) -> MetCounts:
    """The counts `model`'s passes met in this process."""
    return _MET.setdefault(str(model.path), MetCounts())
