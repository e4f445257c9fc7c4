"""agent_steps: answers carried, thinking dropped, budgets shrinking; on the real reasoner."""

from __future__ import annotations

import pytest

import sgl_reason
from sgl_reason.bench.agent import _grade, _merge, agent_plans, plan, run
from sgl_reason.programs.agent import agent_steps, step_budgets


def test_a_step_gets_its_fair_share_of_what_is_left():
    assert step_budgets(None, 128, 16, 5, 10_000) == 128  # no run budget: the step's own
    assert step_budgets(1000, 128, 16, 10, 0) == 100
    assert step_budgets(1000, 128, 16, 2, 900) == 50
    assert step_budgets(1000, 128, 16, 2, 1200) == 16  # spent out: the floor
    assert step_budgets(10_000, 128, 16, 2, 0) == 128  # never above the step's cap


def test_bad_plans_are_refused_before_any_request():
    with pytest.raises(ValueError, match="steps is empty"):
        agent_steps("ctx", [], backend=object())
    with pytest.raises(ValueError, match="carry"):
        agent_steps("ctx", ["a"], carry="thinking", backend=object())
    with pytest.raises(ValueError, match="min_step_budget"):
        agent_steps("ctx", ["a"], step_budget=8, min_step_budget=16, backend=object())


def test_the_bench_grades_each_step_from_its_own_previous_answer():
    moves = [(10, 5), (20, 1)]
    assert _grade(["105", "124"], moves, 100) == {"step_accuracy": 1.0, "chain_correct_steps": 2}
    # a wrong first step: the second is still right from it, the chain is not
    assert _grade(["104", "123"], moves, 100) == {"step_accuracy": 0.5, "chain_correct_steps": 0}


def test_agents_get_their_own_questions_and_their_counts_are_summed():
    farm = agent_plans("farm", 3, seed=0, agents=2)
    assert farm[0].steps[:3] == agent_plans("farm", 3, seed=0)[0].steps  # one agent: unchanged
    assert not set(farm[0].steps) & set(farm[1].steps)
    till = agent_plans("till", 3, seed=0, agents=2)
    assert till[0].first != till[1].first or till[0].steps != till[1].steps
    with pytest.raises(ValueError, match="farm or till"):
        agent_plans("shop", 3, 0)
    row = dict(computed_prefill_tokens=10, prompt_tokens=20, decode_tokens=5, thinking_tokens=3,
               answer_tokens=2, requests=3, kv_token_seconds=7, forced_steps=1,
               peak_kv_tokens=40, last_prompt_tokens=30, step_accuracy=0.5)
    merged = _merge([row, {**row, "peak_kv_tokens": 90, "step_accuracy": 1.0}], seconds=4.0)
    assert merged["computed_prefill_tokens"] == 20 and merged["requests"] == 6
    assert merged["peak_kv_tokens"] == 90 and merged["step_accuracy"] == 0.75


@pytest.mark.server
def test_agents_at_once_keep_their_own_ledgers(reasoner):
    report = run(reasoner.endpoint, steps=2, step_budget=16, max_answer_tokens=16, agents=2,
                 plan_name="till")
    assert report["agents"] == 2 and report["pool_tokens"] > 0
    for row in report["rows"].values():
        # one request a step (the close is forced inside it): a ledger that also counted the
        # other agent's requests would sum to more than 2 agents x 2 steps
        assert row["requests"] == 4
    assert len(report["final_answers"][0]) == 2
    # the naive agents' second prompts carry their first step's thinking
    assert report["rows"]["naive"]["prompt_tokens"] > report["rows"]["steps"]["prompt_tokens"]


@pytest.mark.server
def test_answers_only_prompts_reuse_the_context_and_stay_short(reasoner):
    b = reasoner.endpoint
    context, steps, moves, start = plan(3, seed=1)
    kw = dict(step_budget=48, max_answer_tokens=32, first=str(start), backend=b,
              sampling=sgl_reason.Sampling(temperature=0))
    reasoner.flush_cache()
    lean = agent_steps(context, steps, **kw)
    reasoner.flush_cache()
    naive = agent_steps(context, steps, carry="everything", kv_policy="keep", **kw)
    assert lean.info["kv_policy"] == "strip"  # auto: the server has the thinking-KV cache
    assert len(lean.samples) == 3 and lean.answer == lean.info["answers"][-1]
    assert lean.info["answers"][0] == naive.info["answers"][0]  # same first prompt, greedy
    # later prompts: the naive one carries every earlier thinking, the lean one none (step 1's
    # answers are the same text, so the second prompts differ by step 1's thinking exactly)
    gap = naive.info["prompt_tokens"][1] - lean.info["prompt_tokens"][1]
    assert 0.8 * naive.samples[0].thinking_tokens <= gap <= naive.samples[0].thinking_tokens + 16
    assert naive.info["prompt_tokens"][2] > lean.info["prompt_tokens"][2]
    assert lean.cost.peak_request_tokens < naive.cost.peak_request_tokens
    assert lean.cost.cached_tokens > 0  # steps 2 and 3 reuse the context's cached prefill
