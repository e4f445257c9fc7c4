"""Budgeted think-then-answer against the real server: the budget is a hard bound, in tokens."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sgl_reason.profiles import get_profile
from sgl_reason.programs import TIERS, ThinkingBudget, think_then_answer
from sgl_reason.vote import extract_answer

pytestmark = pytest.mark.server

QUESTION = "A train travels 60 km per hour for 3 hours. How far does it go?"


@pytest.mark.parametrize("mode", ["single", "two"])
@pytest.mark.parametrize("budget_tokens", [5, 24])
def test_thinking_never_exceeds_the_budget(runtime, mode, budget_tokens):
    budget = ThinkingBudget(max_thinking_tokens=budget_tokens, max_answer_tokens=8, mode=mode)
    for _ in range(2):
        result = think_then_answer(QUESTION, budget=budget, backend=runtime.endpoint)
        sample = result.samples[0]
        assert result.info["route"] == mode
        assert 0 < sample.thinking_tokens <= budget_tokens
        assert sample.answer_tokens <= 8
        if sample.forced:
            assert sample.thinking_tokens == budget_tokens
        # thinking and answer are returned separately, split at the marker that closed the
        # thinking: it is in neither (SmolLM2 may write it again in its answer, even first
        # thing: that text is its own, so the split is checked, not the answer's first words)
        marker = get_profile(result.info["profile"]).think_end
        assert "</reasoning>" not in sample.thinking
        assert sample.text == sample.thinking + marker + sample.answer_text
        assert result.cost.thinking_tokens == sample.thinking_tokens
        # an answer its 8 tokens cut is read as cut (a number at its end may be unfinished); on
        # the single route the processor cuts it with a forced EOS, which finishes as "stop"
        cut = sample.finish_reason == "length" or (mode == "single" and sample.answer_tokens == 8)
        assert sample.answer == extract_answer(sample.answer_text, cut=cut)


def test_single_route_is_one_request(runtime):
    budget = ThinkingBudget(max_thinking_tokens=16, max_answer_tokens=8, mode="single")
    result = think_then_answer(QUESTION, budget=budget, backend=runtime.endpoint)
    assert result.cost.requests == 1
    # the prompted SmolLM2 never writes the marker itself: the server forced it at the budget
    assert result.samples[0].forced and result.samples[0].thinking_tokens == 16
    assert result.cost.decode_tokens == 16 + result.info["marker_tokens"] + result.samples[0].answer_tokens


def test_minimum_thinking_reopens_with_wait(runtime):
    budget = ThinkingBudget(max_thinking_tokens=40, min_thinking_tokens=30, max_answer_tokens=4)
    result = think_then_answer(QUESTION, budget=budget, backend=runtime.endpoint)
    assert result.info["route"] == "two"  # a minimum needs the multi-request route
    assert 30 <= result.samples[0].thinking_tokens <= 40 or result.samples[0].forced


def test_single_mode_without_processor_names_the_flag(runtime, monkeypatch):
    backend = runtime.endpoint.scoped()
    backend._server_info = {"enable_custom_logit_processor": False}  # this copy only
    with pytest.raises(ValueError, match="--enable-custom-logit-processor"):
        think_then_answer(QUESTION, budget=ThinkingBudget(max_thinking_tokens=8, mode="single"),
                          backend=backend)
    result = think_then_answer(QUESTION, budget=ThinkingBudget(max_thinking_tokens=8,
                               max_answer_tokens=4), backend=backend)
    assert result.info["route"] == "two"  # auto falls back


def test_budget_config():
    assert ThinkingBudget().thinking_tokens == TIERS["low"] == 4096
    assert ThinkingBudget(max_thinking_tokens="high").thinking_tokens == 65536
    assert ThinkingBudget(max_thinking_tokens=123).thinking_tokens == 123
    with pytest.raises(ValidationError, match="exceeds max_thinking_tokens"):
        ThinkingBudget(max_thinking_tokens=10, min_thinking_tokens=11)
    with pytest.raises(ValidationError, match="must be >= 1"):
        ThinkingBudget(max_thinking_tokens=0)
    with pytest.raises(ValidationError):
        ThinkingBudget(max_thinking_tokens="huge")
