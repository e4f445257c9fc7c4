"""Self-consistency against the real embedded server: prefill shared, costs add up."""

from __future__ import annotations

import pytest

from sgl_reason.bench import prefix_sharing
from sgl_reason.profiles import Sampling
from sgl_reason.programs import ThinkingBudget, self_consistency

pytestmark = pytest.mark.server

QUESTION = "Tom has 3 boxes with 4 apples each. He eats 2 apples. How many apples are left?"


def test_n8_on_2000_tokens_prefills_once(runtime):
    """N=8 computes <= 1.05x the prefill of one sample; 8 independent requests about 8x."""
    report = prefix_sharing.run(runtime.endpoint, n=8, prompt_tokens=2000, new_tokens=4)
    single, naive, shared = report["single"], report["naive"], report["shared"]
    assert single["prompt_tokens"] >= 2000
    assert shared["computed_prefill_tokens"] <= 1.05 * single["computed_prefill_tokens"]
    assert 7.5 <= naive["computed_prefill_tokens"] / single["computed_prefill_tokens"] <= 8.5
    assert shared["decode_tokens"] == naive["decode_tokens"] == 8 * 4
    assert shared["requests"] == 9  # one prefix commit + 8 branches


def test_vote_and_ledger(fresh_cache):
    result = self_consistency(QUESTION, n=4, max_tokens=24, backend=fresh_cache.endpoint)
    assert len(result.samples) == 4
    assert result.vote.n_samples == 4
    assert result.answer == result.vote.answer
    if result.answer is not None:
        assert result.answer in [s.answer for s in result.samples]
    cost = result.cost
    assert cost.requests == 5
    assert cost.decode_tokens == cost.answer_tokens == sum(s.answer_tokens for s in result.samples)
    assert cost.computed_prefill_tokens == cost.prompt_tokens - cost.cached_tokens
    prompt = cost.prompt_tokens // 5
    assert cost.computed_prefill_tokens <= prompt + 4 * 2  # prompt once + each branch's last token
    assert cost.seconds > 0 and cost.kv_token_seconds > 0


def test_ignore_eos_decodes_exact_lengths(runtime):
    result = self_consistency(QUESTION, n=2, max_tokens=7, backend=runtime.endpoint,
                              sampling=Sampling(temperature=0.8, ignore_eos=True))
    assert [s.answer_tokens for s in result.samples] == [7, 7]


def test_composes_with_think_then_answer(runtime):
    """Self-consistency over budgeted think-then-answer branches: every branch obeys the budget."""
    budget = ThinkingBudget(max_thinking_tokens=12, max_answer_tokens=6)
    result = self_consistency(QUESTION, n=3, think=budget, backend=runtime.endpoint)
    assert len(result.samples) == 3
    for sample in result.samples:
        assert 0 < sample.thinking_tokens <= 12
        assert sample.answer_tokens <= 6
    assert result.cost.thinking_tokens == sum(s.thinking_tokens for s in result.samples)


def test_bad_n():
    with pytest.raises(ValueError, match="n must be >= 1"):
        self_consistency(QUESTION, n=0, backend=object())


def _greedy_confidence(backend, question: str, max_tokens: int) -> float:
    """The confidence of one plain greedy request with top-5 logprobs, written by the program's
    own prompt code: what a weighted vote's greedy sample must score."""
    import sglang as sgl

    from sgl_reason.early_stop.confidence import trace_confidence
    from sgl_reason.programs.chunked import top_logprobs
    from sgl_reason.programs.common import finished, open_prompt, resolve_profile

    @sgl.function
    def one(s):
        open_prompt(s, question, resolve_profile(backend, None))
        s += sgl.gen("out", max_tokens=max_tokens, temperature=0, return_logprob=True,
                     top_logprobs_num=5)

    state = one.run(backend=backend)
    return trace_confidence(top_logprobs(finished(state, "out")[1]))


def test_a_vote_weighted_by_confidence_weighs_each_trace_by_its_logprobs(runtime):
    """VoteConfig(weigh="confidence"): every sample scores its own request's confidence (the
    same as a lone request's, greedy) and the vote sums those scores; nothing is dropped and no
    request is added."""
    from sgl_reason.vote import VoteConfig

    weigh = VoteConfig(weigh="confidence")
    greedy = Sampling(temperature=0)
    # one branch, so that it decodes alone as the lone request does (batching can flip a greedy
    # token of this model)
    one = self_consistency(QUESTION, n=1, max_tokens=24, backend=runtime.endpoint,
                           sampling=greedy, vote_config=weigh)
    expected = _greedy_confidence(runtime.endpoint, QUESTION, 24)
    assert expected > 0 and one.samples[0].score == pytest.approx(expected, rel=1e-2)
    result = self_consistency(QUESTION, n=3, max_tokens=24, backend=runtime.endpoint,
                              vote_config=weigh)
    assert result.cost.requests == 4  # one prefix commit + 3 branches: no request added
    assert all(s.score is not None and s.score > 0 for s in result.samples)
    answered = sum(s.score for s in result.samples if s.answer)
    assert sum(result.vote.votes.values()) == pytest.approx(answered)
    budget = ThinkingBudget(max_thinking_tokens=16, max_answer_tokens=6)
    thought = self_consistency(QUESTION, n=3, think=budget, backend=runtime.endpoint,
                               vote_config=weigh)
    # SmolLM2 never closes its thinking: every branch is forced at the budget, and the forced
    # tokens (masked but for one) are left out of its confidence
    assert all(s.forced for s in thought.samples)
    assert all(s.score is not None and 0 < s.score < 100 for s in thought.samples)
    plain = self_consistency(QUESTION, n=2, max_tokens=8, backend=runtime.endpoint)
    assert all(s.score is None for s in plain.samples)


def test_a_vote_weighted_by_confidence_refuses_chunked_traces(runtime):
    from sgl_reason.early_stop import EarlyStop
    from sgl_reason.vote import VoteConfig

    with pytest.raises(ValueError, match="signal='confidence'"):
        self_consistency(QUESTION, n=2, think=ThinkingBudget(max_thinking_tokens=64),
                         backend=runtime.endpoint, vote_config=VoteConfig(weigh="confidence"),
                         early_stop=EarlyStop(signal="entropy"))
