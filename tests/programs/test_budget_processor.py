"""The budget-forcing logit processor's state machine, driven step by step (no server)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_reason.programs.budget import BudgetForcingProcessor, budget_params_problem

VOCAB, EOS = 50, 2
END = [7, 8, 9]


def drive(params, sampled, steps, lag=lambda t: 0):
    """Run the processor as the scheduler would: one call per token; the model would sample
    ``sampled(t)`` unless the processor forces a token (argmax of a masked row). ``lag(t)``:
    how many of the tokens already sampled the call for token ``t`` does not see yet in
    ``output_ids`` (the overlap scheduler processes a step's result after the next launch)."""
    req = SimpleNamespace(output_ids=[], eos_token_ids={EOS}, tokenizer=None,
                          sampling_params=SimpleNamespace(stop_token_ids=None))
    params = dict(params, __req__=req)
    proc, out = BudgetForcingProcessor(), []
    for t in range(steps):
        req.output_ids = out[:len(out) - min(lag(t), len(out))]
        logits = torch.zeros(1, VOCAB)
        logits[0, sampled(t)] = 5.0
        logits[0, EOS] = 4.0
        token = int(proc(logits, [params])[0].argmax())
        out.append(token)
        if token == EOS:
            break
    return out


def test_forces_the_marker_at_the_budget_then_bounds_the_answer():
    out = drive({"budget": 5, "end_ids": END, "max_answer": 4}, lambda t: 20 + t, 30)
    assert out[:5] == [20, 21, 22, 23, 24]  # thinking: exactly the budget
    assert out[5:8] == END  # the forced marker
    assert len(out[8:]) == 4 and out[-1] == EOS  # the answer's 4th token is a forced EOS


def test_eos_is_masked_while_thinking():
    out = drive({"budget": 4, "end_ids": END, "max_answer": 3}, lambda t: EOS, 20)
    assert out[:4] != [EOS] * 4 and EOS not in out[:4]


def test_models_own_marker_ends_thinking_early():
    script = [30, 31] + END + [40, 41, 42, 43, 44]
    out = drive({"budget": 50, "end_ids": END, "max_answer": 3},
                lambda t: script[t] if t < len(script) else 45, 20)
    assert out[:5] == [30, 31, *END]
    # the marker is seen one step late at most; the answer stops within max_answer + 1
    assert len(out) <= 5 + 3 + 1 and out[-1] == EOS


def test_a_single_token_marker_is_found_whatever_text_merged_before_it():
    """Real reasoners write "</think>" as one token after a merged one (".\n"): detection
    matches ``marker_ids``, not the whole forced text."""
    merged_newline, marker = 33, 8
    script = [30, 31, merged_newline, marker, 9, 40, 41, 42, 43, 44]
    out = drive({"budget": 50, "end_ids": END, "marker_ids": [marker], "max_answer": 3},
                lambda t: script[t] if t < len(script) else 45, 20)
    assert out[:4] == [30, 31, merged_newline, marker]
    assert len(out) <= 4 + 3 + 1 and out[-1] == EOS  # the answer limit applied after it
    # matching the whole forced text instead never sees a close: the answer runs on
    out = drive({"budget": 50, "end_ids": END, "max_answer": 3},
                lambda t: script[t] if t < len(script) else 45, 20)
    assert EOS not in out


def test_a_marker_is_found_when_a_call_sees_two_new_tokens_at_once():
    """Under the overlap scheduler a call sees the output one step late; when a prefill batch
    runs between two decode steps, both steps' results land before the next call, which then
    sees two new tokens: the marker may be the one before the last."""
    marker = 8
    script = [30, 31, 32, marker, 40, 41, 42, 43, 44]
    lag = lambda t: 0 if t == 5 else 1  # the call for token 5 sees tokens 3 and 4 at once
    out = drive({"budget": 50, "end_ids": END, "marker_ids": [marker], "max_answer": 3},
                lambda t: script[t] if t < len(script) else 45, 20, lag)
    assert out[:4] == [30, 31, 32, marker]
    assert len(out) == 4 + 3 and out[-1] == EOS  # the answer limit counted from the marker
    # the same with no lag, and with a steady lag: the answer is as long
    for steady in (lambda t: 0, lambda t: 1):
        again = drive({"budget": 50, "end_ids": END, "marker_ids": [marker], "max_answer": 3},
                      lambda t: script[t] if t < len(script) else 45, 20, steady)
        assert again == out


@pytest.mark.parametrize("params, problem", [
    ({"budget": "64", "end_ids": END, "max_answer": 4}, "budget must be an integer >= 0"),
    ({"budget": -1, "end_ids": END, "max_answer": 4}, "budget must be an integer >= 0"),
    ({"budget": True, "end_ids": END, "max_answer": 4}, "budget must be an integer >= 0"),
    ({"budget": 8, "end_ids": [], "max_answer": 4}, "end_ids must be a non-empty list"),
    ({"budget": 8, "end_ids": [7, VOCAB], "max_answer": 4}, f"token ids below {VOCAB}"),
    ({"budget": 8, "end_ids": "</think>", "max_answer": 4}, "end_ids must be"),
    ({"budget": 8, "end_ids": END, "marker_ids": [-1], "max_answer": 4}, "marker_ids must be"),
    ({"budget": 8, "end_ids": END, "eos_ids": [None], "max_answer": 4}, "eos_ids must be"),
    ({"budget": 8, "end_ids": END, "max_answer": 0}, "max_answer must be an integer >= 1"),
    ({"budget": 8, "end_ids": END}, "max_answer must be an integer >= 1"),
    ({"budget": 8, "end_ids": END, "max_answer": 4, "min_answer": 5},
     "min_answer must be an integer between 0 and max_answer (4)"),
])
def test_bad_budget_params_are_named_before_the_scheduler_sees_them(params, problem):
    assert problem in budget_params_problem(params, VOCAB)


def test_good_budget_params_pass():
    assert budget_params_problem({"budget": 0, "end_ids": END, "max_answer": 1}, VOCAB) is None
    assert budget_params_problem({"budget": 9, "end_ids": END, "marker_ids": [9], "eos_ids": [2],
                                  "max_answer": 4, "min_answer": 4}, VOCAB) is None


def test_the_processor_leaves_a_request_with_bad_params_alone():
    """Bad params never raise inside the sampling step: the row is not touched."""
    logits = torch.zeros(2, VOCAB)
    params = [{"budget": "64", "end_ids": END, "max_answer": 4}, {"budget": 0, "end_ids": [VOCAB]}]
    out = BudgetForcingProcessor()(logits.clone(), params)
    assert torch.equal(out, logits) and params[0]["_ok"] is False and params[1]["_ok"] is False


def test_kv_policy_sets_what_a_release_keeps_per_call():
    from pydantic import ValidationError

    from sgl_reason.programs.budget import KVPolicy, kv_params

    assert kv_params(None) == {} and kv_params("strip") == {"thinking_kv_policy": "strip"}
    rule = KVPolicy(name="release-on-pressure", keep=0.25, score="max")
    assert kv_params(rule) == {"thinking_kv_policy": "release-on-pressure",
                               "thinking_kv_keep": 0.25, "thinking_kv_score": "max"}
    for bad in ({"name": "drop"}, {"name": "release-on-answer", "keep": 1.5},
                {"name": "release-on-answer", "keep": -3}):
        with pytest.raises(ValidationError):
            KVPolicy(**bad)
