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
