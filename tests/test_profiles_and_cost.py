"""Model profiles and the cost ledger (no server)."""

from __future__ import annotations

import threading

import pytest

from sgl_reason.cost import Cost, CostRecorder
from sgl_reason.profiles import PROFILES, Sampling, get_profile, profile_for
from sgl_reason.programs.common import sampling_kwargs


@pytest.mark.parametrize("name,expected", [
    ("Qwen/Qwen3-8B", "qwen3"),
    ("/models/QwQ-32B", "qwq"),
    ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "deepseek-r1"),
    ("/root/.cache/sgl-reason/models/SmolLM2-135M-Instruct-bfloat16", "prompted"),
])
def test_profile_from_model_name(name, expected):
    assert profile_for(name).name == expected


def test_unknown_profile_lists_choices():
    with pytest.raises(ValueError, match=r"Supported profiles: \['deepseek-r1', 'prompted'"):
        get_profile("llama-think")


def test_every_profile_has_markers():
    for p in PROFILES.values():
        assert p.think_end.strip() and p.think_start


def test_min_p_reaches_the_request_only_when_set():
    profile = get_profile("reasoner")
    assert "min_p" not in sampling_kwargs(profile, Sampling(temperature=0.7))
    kwargs = sampling_kwargs(profile, Sampling(temperature=0.7, min_p=0.1))
    assert kwargs["min_p"] == 0.1 and kwargs["temperature"] == 0.7
    with pytest.raises(ValueError, match="min_p"):
        Sampling(min_p=1.5)


def test_costs_add_up():
    a = Cost(requests=1, prompt_tokens=10, cached_tokens=4, computed_prefill_tokens=6,
             decode_tokens=3, seconds=1.5)
    b = Cost(requests=2, prompt_tokens=5, decode_tokens=1, seconds=0.5)
    total = sum([a, b])
    assert total.requests == 3 and total.prompt_tokens == 15 and total.seconds == 2.0
    assert (a + b) == total


def test_peak_request_tokens_is_the_largest_request_not_a_sum():
    recorder = CostRecorder()
    recorder.record({"prompt_tokens": 100, "completion_tokens": 20})
    recorder.record({"prompt_tokens": 50, "cached_tokens": 40, "completion_tokens": 90})
    cost = recorder.snapshot()
    assert cost.peak_request_tokens == 140  # the second: prompt 50 + 90 generated
    assert (cost + Cost(peak_request_tokens=30)).peak_request_tokens == 140


def test_recorder_is_thread_safe():
    recorder = CostRecorder()
    meta = {"prompt_tokens": 10, "cached_tokens": 9, "completion_tokens": 2, "e2e_latency": 0.5}

    def work():
        for _ in range(500):
            recorder.record(meta)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cost = recorder.snapshot()
    assert cost.requests == 2000 and cost.computed_prefill_tokens == 2000
    assert cost.kv_token_seconds == pytest.approx(2000 * (1 + 2 / 2) * 0.5)
