"""A researcher's own ``@sgl.function``: ``sgl_reason.think`` inside it, its cost tracked, its
thinking-KV policy per call, branches through ``sgl_reason.forks``. Runs on the real server
(the tiny reasoner; the branching example on the default model)."""

from __future__ import annotations

import re

import pytest
import requests
import sglang as sgl

import sgl_reason

QUESTION = "What is 37 + 48 + 91?"
GREEDY = sgl_reason.Sampling(temperature=0)
RELEASED = "sgl_reason:thinking_kv_released_tokens_total"


@sgl.function
def two_attempts(s, question, budget, kv_policy=None):
    """The user guide's worked example: think once briefly, then again with the first answer
    in view, and keep both samples."""
    s += sgl.user(question)
    s += sgl.assistant_begin()
    first = sgl_reason.think(s, budget, kv_policy=kv_policy, sampling=GREEDY)
    s += sgl.assistant_end()
    s += sgl.user(f"You answered {first.answer}. Check it once more.")
    s += sgl.assistant_begin()
    second = sgl_reason.think(s, budget, kv_policy=kv_policy, sampling=GREEDY)
    s["samples"] = [first, second]


@sgl.function
def three_guesses(s, question):
    """The user guide's branching example."""
    s += sgl.user(question)
    s += sgl.assistant_begin()
    with sgl_reason.forks(s, 3) as branches:
        for b in branches:  # gen is asynchronous: the three requests decode as one batch
            b += sgl.gen("guess", max_tokens=16, temperature=0.7)
        s["guesses"] = [b["guess"] for b in branches]


@pytest.mark.server
def test_forks_in_a_users_program_prefill_the_prompt_once(fresh_cache):
    with sgl_reason.track(fresh_cache.endpoint) as cost:
        state = three_guesses.run(question=QUESTION, backend=fresh_cache.endpoint)
        state.sync()
    assert len(state["guesses"]) == 3
    spent = cost()
    assert spent.requests == 4  # the prefix commit + one per branch
    prompt = spent.prompt_tokens // 4
    assert spent.computed_prefill_tokens <= prompt + 3 * 2, spent  # once, not 3 times


def _released(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(RELEASED)} (\S+)$", text, re.M)
    assert match, f"{RELEASED} not on /metrics"
    return float(match.group(1))


@pytest.mark.server
def test_think_in_a_users_program_is_costed_from_the_servers_counts(reasoner):
    b = reasoner.endpoint
    with sgl_reason.track(b) as cost:
        state = two_attempts.run(question=QUESTION, budget=48, backend=b)
        state.sync()
    first, second = state["samples"]
    for sample in (first, second):
        assert 0 < sample.thinking_tokens <= 48  # the hard bound holds in a user's program
        assert sample.answer_tokens > 0 and sample.answer is not None
    c = cost()
    # one request per think() on the single route; the ledger is the server's own counts
    assert c.requests == 2
    profile = sgl_reason.profile_for(b.get_model_name())
    marker = len(b.fixed_ids(profile.think_end))  # at most the forced text, at least the token
    decoded = sum(x.thinking_tokens + x.answer_tokens for x in (first, second))
    assert decoded + 2 <= c.decode_tokens <= decoded + 2 * marker
    assert c.computed_prefill_tokens < c.prompt_tokens  # the second prompt reuses the first


@pytest.mark.server
def test_a_per_call_kv_policy_reaches_the_server(reasoner):
    b, url = reasoner.endpoint, reasoner.url
    before = _released(url)
    two_attempts.run(question=QUESTION, budget=48, backend=b).sync()
    assert _released(url) == before  # the server's default here is keep
    state = two_attempts.run(question=QUESTION, budget=48, kv_policy="release-on-answer",
                             backend=b)
    state.sync()
    assert _released(url) > before
    with pytest.raises(ValueError, match="release-on-answer"):
        two_attempts.run(question=QUESTION, budget=48, kv_policy="release", backend=b).sync()


@pytest.mark.server
def test_the_built_in_program_is_think_on_an_opened_prompt(reasoner):
    """think_then_answer is open_prompt + think: the same greedy sample either way."""
    from sgl_reason.programs.common import open_prompt

    @sgl.function
    def mine(s, question):
        open_prompt(s, question, sgl_reason.profile_for(reasoner.endpoint.get_model_name()))
        s["sample"] = sgl_reason.think(s, 64, sampling=GREEDY)

    state = mine.run(question=QUESTION, backend=reasoner.endpoint)
    state.sync()
    built_in = sgl_reason.think_then_answer(QUESTION, budget=sgl_reason.ThinkingBudget(
        max_thinking_tokens=64), sampling=GREEDY, backend=reasoner.endpoint)
    assert state["sample"].text == built_in.samples[0].text


@pytest.mark.server
def test_arun_runs_programs_from_asyncio_as_run_does(reasoner):
    import asyncio

    b = reasoner.endpoint
    budget = sgl_reason.ThinkingBudget(max_thinking_tokens=48)

    async def both():
        return await asyncio.gather(
            sgl_reason.arun(sgl_reason.think_then_answer, QUESTION, budget=budget,
                            sampling=GREEDY, backend=b),
            sgl_reason.arun(two_attempts, question=QUESTION, budget=48, backend=b),
        )

    # alone, arun decodes exactly what run does: greedy, a batch of one, and an empty cache
    # both times (a prompt read from the cache is prefilled in another order, and bf16 on the
    # CPU may then flip a greedy digit)
    reasoner.flush_cache()
    alone = asyncio.run(sgl_reason.arun(sgl_reason.think_then_answer, QUESTION, budget=budget,
                                        sampling=GREEDY, backend=b))
    reasoner.flush_cache()
    sync = sgl_reason.think_then_answer(QUESTION, budget=budget, sampling=GREEDY, backend=b)
    assert alone.samples[0].text == sync.samples[0].text and alone.cost.requests == 1
    # together on one event loop, each program completes with its own ledger (texts are not
    # compared: batched and cached decoding may flip a digit)
    result, state = asyncio.run(both())
    assert result.cost.requests == 1 and result.cost.prompt_tokens == sync.cost.prompt_tokens
    assert 0 < result.cost.thinking_tokens <= 48
    assert len(state["samples"]) == 2
    assert all(0 < x.thinking_tokens <= 48 and x.text for x in state["samples"])
    with pytest.raises(TypeError, match="entry point"):
        asyncio.run(sgl_reason.arun("self_consistency"))
