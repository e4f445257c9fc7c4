"""``sgl_reason.track()``: the cost of a block, for programs a user writes."""

from __future__ import annotations

import pytest
import sglang as sgl

import sgl_reason
from sgl_reason import tracking

META = {"prompt_tokens": 10, "cached_tokens": 4, "completion_tokens": 3, "e2e_latency": 0.5}


def test_a_block_counts_the_requests_of_its_server_only_while_it_runs(monkeypatch):
    monkeypatch.setattr(sgl.global_config, "default_backend", None)
    tracking.record("http://a", META)  # before the block: not counted
    with sgl_reason.track() as every:  # no default backend: every server
        tracking.record("http://a", META)
        tracking.record("http://b", META)
    tracking.record("http://a", META)  # after: not counted
    cost = every()
    assert (cost.requests, cost.prompt_tokens, cost.computed_prefill_tokens,
            cost.decode_tokens) == (2, 20, 12, 6)
    assert cost.seconds == every.cost.seconds  # frozen when the block ended
    assert tracking._ACTIVE == []


def test_only_a_reason_backend_can_be_tracked():
    with pytest.raises(TypeError, match="use sgl_reason.ReasonBackend\\(url\\) in its place"):
        with sgl_reason.track(object()):
            pass


@sgl.function
def two_questions(s, a, b):
    s += f"Q: {a}\nA:" + sgl.gen("x", max_tokens=6, temperature=0)
    s += f"\nQ: {b}\nA:" + sgl.gen("y", max_tokens=6, temperature=0)


@pytest.mark.server
def test_a_users_program_costs_what_the_server_counted(runtime):
    """The worked example of the user guide: a plain @sgl.function and a built-in program in
    one block; the ledger is the sum of the server's own per-request counts."""
    backend = runtime.endpoint
    with sgl_reason.track(backend) as cost:
        state = two_questions.run(a="2+2?", b="3+3?", backend=backend)
        state.sync()  # run() returns while its last gen may still be in flight
        result = sgl_reason.self_consistency("What is 17 + 25?", n=2, max_tokens=8,
                                             backend=backend)
    metas = [state.get_meta_info("x"), state.get_meta_info("y")]
    c = cost()
    assert c.requests == 2 + result.cost.requests
    assert c.decode_tokens == sum(m["completion_tokens"] for m in metas) + result.cost.decode_tokens
    assert c.prompt_tokens == sum(m["prompt_tokens"] for m in metas) + result.cost.prompt_tokens
    assert c.computed_prefill_tokens == (
        sum(m["prompt_tokens"] - m["cached_tokens"] for m in metas)
        + result.cost.computed_prefill_tokens)
    assert c.seconds >= result.cost.seconds > 0
