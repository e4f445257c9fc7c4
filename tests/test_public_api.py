"""The public API is listed in __all__ and every name resolves."""

import sgl_reason
import sgl_reason.programs
import sgl_reason.vote


def test_all_names_resolve():
    for module in (sgl_reason, sgl_reason.programs, sgl_reason.vote):
        for name in module.__all__:
            assert getattr(module, name) is not None, (module.__name__, name)


def test_programs_are_exported_at_the_top():
    for name in ("self_consistency", "think_then_answer", "best_of_n", "EmbeddedRuntime",
                 "ReasonBackend", "ThinkingBudget", "ModelProfile", "VoteConfig", "Cost",
                 "track", "think", "forks", "arun", "normalize", "EarlyStop", "load_problems", "evaluate", "Sampling"):
        assert name in sgl_reason.__all__


def test_track_is_the_function_not_its_module():
    import sgl_reason.tracking  # importing the module must not shadow the public name

    assert callable(sgl_reason.track) and sgl_reason.track is sgl_reason.tracking.track


def test_evaluate_is_the_module_with_run():
    import sgl_reason.evaluate

    assert sgl_reason.evaluate is sgl_reason.__getattr__("evaluate")
    assert callable(sgl_reason.evaluate.run) and callable(sgl_reason.evaluate.summary_table)


def test_think_budget_forms_and_kv_policy_checks():
    import pytest

    from sgl_reason.programs.budget import KV_POLICIES, THINKING_START, as_budget, check_kv_policy
    from sgl_reason.runtime.thinking_kv import POLICIES
    from sgl_reason.runtime.thinking_kv.policy import THINKING_START as SERVER_THINKING_START

    assert KV_POLICIES == POLICIES  # the programs' copy of the server's list
    assert THINKING_START == SERVER_THINKING_START
    assert as_budget(None).thinking_tokens == 4096
    assert as_budget(64).thinking_tokens == 64 and as_budget("medium").thinking_tokens == 16384
    assert as_budget(sgl_reason.ThinkingBudget(max_thinking_tokens=7)).thinking_tokens == 7
    with pytest.raises(TypeError, match="token count"):
        as_budget(1.5)
    with pytest.raises(ValueError, match="release-on-answer"):
        check_kv_policy("release")
    assert check_kv_policy(None) is None and check_kv_policy("strip") == "strip"
