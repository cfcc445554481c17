"""Whether speculation pays: the one place where specrun weighs a tree against plain decoding.

`rules`: every decision's rule and threshold, each with the measurement it came from (tune's
prediction and check, a profile's drift at load, whether the draft model could pay at all, the
size a drafter's hindsight says pays); `guard`: the speed guard, speculation measured against plain
steps during a run; `steps`: what a speculative decoder proposes each step, and at what size;
`together`: whether requests decoding together draft with the draft model, measured in turns;
`counts`: the token counts (and rows of logits) a model's passes met, to which a pass over RPC
workers is filled.
"""
