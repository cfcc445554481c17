"""A long-running `specrun serve` never stays stuck in what one request taught its adaptation.

A real server on the demo pair. Sampled answers at a high temperature accept few draft tokens,
so the speed guard rightly cuts their trees, down to plain steps; greedy requests that copy
their prompt must still get their trees (a guard per kind of request), and sampled ones get
theirs back within a few requests (a cut cap grows back at each request). Asserted on the
tokens accepted per pass that each response's timings report, not on wall time.
"""

from __future__ import annotations

import openai
from test_server import TARGET, ServerProcess

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, "
           "and wrote the weather in a leather logbook before the ships came in.")


def _ask(client, content: str, **sampling) -> dict:
    reply = client.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": content}], **sampling)
    return reply.model_extra["timings"]


def test_sampled_requests_do_not_leave_greedy_copies_without_speculation(offline_models, tmp_path):
    # The draft model's chain of 2 alone (--no-lookup): every step is a speculative step the guard
    # judges, and two cuts (2 -> 1 -> 0) reach plain steps.
    srv = ServerProcess(tmp_path / "home", "--no-lookup", "--budget", "2", "--verbose")
    try:
        srv.wait_ready()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
        # No seed: a seeded sample is decoded plainly (same seed, same answer), never speculatively.
        sampled = [_ask(client, "Tell me a story about a cat.", max_tokens=48, temperature=3.0)
                   for _ in range(2)]
        greedy = [_ask(client, f"Repeat this sentence exactly: {PASSAGE}", max_tokens=24, temperature=0)
                  for _ in range(2)]
    finally:
        assert srv.terminate() == 0, srv.stderr
    # The sampled answers did cut the trees (the state that used to stick).
    assert "switching to" in srv.stderr, srv.stderr
    assert min(t["accepted_per_pass"] for t in sampled) < 1.5
    # Greedy copies speculate from their first request on.
    assert greedy[0]["accepted_per_pass"] >= 1.8, greedy
    assert all(t["draft_n_accepted"] > 0 for t in greedy)
