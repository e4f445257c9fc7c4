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
                 "track", "EarlyStop", "load_problems"):
        assert name in sgl_reason.__all__


def test_track_is_the_function_not_its_module():
    import sgl_reason.tracking  # importing the module must not shadow the public name

    assert callable(sgl_reason.track) and sgl_reason.track is sgl_reason.tracking.track
