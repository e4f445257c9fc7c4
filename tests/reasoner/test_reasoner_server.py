"""The tiny reasoner on the real SGLang server: it closes its own thinking with its single
marker token, budget forcing still binds, and thinking-KV release finds the model's marker."""

from __future__ import annotations

import re

import pytest
import requests

from sgl_reason.programs import ThinkingBudget, think_then_answer
from sgl_reason.programs.budget import BudgetForcingProcessor
from sgl_reason.profiles import Sampling

pytestmark = [pytest.mark.server, pytest.mark.slow]

SINK, WINDOW = 4, 16  # the plugin's defaults (the `reasoner` fixture: tests/conftest.py)
QUESTION = "State the final answer to the following arithmetic problem: 12 + 7 - 5 ="
GREEDY = Sampling(temperature=0)


def _tokenize(url: str, text: str) -> list[int]:
    r = requests.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                      timeout=30)
    r.raise_for_status()
    return r.json()["tokens"]


def _metric(url: str, name: str) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, f"{name} not on /metrics"
    return float(match.group(1))


def test_the_reasoner_closes_its_own_thinking_and_answers_from_it(reasoner):
    budget = ThinkingBudget(max_thinking_tokens=400, max_answer_tokens=64)
    result = think_then_answer(QUESTION, budget=budget, backend=reasoner.endpoint, sampling=GREEDY)
    s = result.samples[0]
    assert result.info["profile"] == "reasoner" and result.info["route"] == "single"
    assert not s.forced and 20 < s.thinking_tokens < 400, s
    assert "Check" in s.thinking and result.answer == "14", s.text
    # budget forcing would write 3 tokens ("\n", "</think>", "\n"); the model's own close was
    # found by its one marker token, which ends the thinking and is counted in neither part
    assert result.info["marker_tokens"] == 3 and "</think>" not in s.thinking
    assert s.answer_tokens == result.cost.decode_tokens - s.thinking_tokens - 1


def test_budget_forcing_still_binds_on_the_reasoner(reasoner):
    budget = ThinkingBudget(max_thinking_tokens=24, max_answer_tokens=48)
    result = think_then_answer(QUESTION, budget=budget, backend=reasoner.endpoint, sampling=GREEDY)
    s = result.samples[0]
    assert s.forced and s.thinking_tokens == 24
    assert result.cost.decode_tokens == 24 + 3 + s.answer_tokens
    assert s.answer is not None  # the model answers from the cut thinking


def test_release_on_answer_finds_the_models_own_marker(reasoner):
    """A request closed by the model: thinking KV is released from its own marker token."""
    url = reasoner.url
    marker = _tokenize(url, "</think>")
    assert len(marker) == 1
    prompt = (f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n<think>\n")
    before = _metric(url, "sgl_reason:thinking_kv_released_tokens_total")
    out = requests.post(url + "/generate", timeout=600, json={
        "text": prompt, "return_logprob": True,
        "custom_logit_processor": BudgetForcingProcessor.to_str(),
        "sampling_params": {"temperature": 0, "max_new_tokens": 480, "custom_params": {
            "budget": 400, "end_ids": _tokenize(url, "\n</think>\n"), "marker_ids": marker,
            "max_answer": 64, "thinking_kv_policy": "release-on-answer"}},
    }).json()
    ids = [t[1] for t in out["meta_info"]["output_token_logprobs"]]
    m = ids.index(marker[0])
    assert m < 400, "the model did not close its thinking"
    released = _metric(url, "sgl_reason:thinking_kv_released_tokens_total") - before
    assert released == m - SINK - WINDOW
    # the answer starts as the model's answers do, restating the problem; its value is not
    # asserted: with only the sink and the window kept, v1's answer read "12 + 7 - 5 = 12 - 5 =
    # 6" where keep's says 14, v2's looped ("= 12 + 5 = 12 + 5 = ...") until max_answer, v3's
    # reads "12 + 7 = 19, 12 - 5 = 6" (the quality cost issue 17 is about)
    assert out["text"].split("</think>", 1)[1].strip().startswith("12 + 7")


def test_a_cue_probe_stops_the_reasoner_when_it_turns_to_its_check(reasoner):
    """DEER's trigger on the reasoner's own transition word: no probe before "Check" is
    written; the one probe, at the "Check", states the result and ends the thinking."""
    from sgl_reason.early_stop import EarlyStop

    budget = ThinkingBudget(max_thinking_tokens=400, max_answer_tokens=64, mode="two")
    full = think_then_answer(QUESTION, budget=budget, backend=reasoner.endpoint, sampling=GREEDY,
                             early_stop=EarlyStop(signal="none", chunk_tokens=16))
    cue = EarlyStop(signal="probe", chunk_tokens=16, probe_cues=("Check", "Wait"),
                    probe_agree=1, probe_confidence=0.9)
    result = think_then_answer(QUESTION, budget=budget, backend=reasoner.endpoint,
                               sampling=GREEDY, early_stop=cue)
    s = result.samples[0]
    assert s.stopped is not None and s.stopped["answer_from_probe"], s
    assert s.thinking == full.samples[0].thinking[:len(s.thinking)]  # the same trace, cut
    assert "Check" in s.thinking
    assert s.thinking_tokens < full.samples[0].thinking_tokens
    assert result.answer == full.answer == "14"
    # one probe (read from the trace cut before "Check": it states the result, not a number
    # of the check) besides the thinking chunks, and no answer request
    chunks = -(-s.thinking_tokens // 16)
    assert result.cost.requests == chunks + 1
    assert result.cost.decode_tokens < full.cost.decode_tokens


@pytest.mark.extended
def test_chunked_thinking_runs_past_32_chunks(reasoner):
    """SGLang's interpreter appends the chat template's stop strings to the stop list it is
    given: a list shared by every chunk grew by one per chunk until the server refused the
    33rd string. Chunks of 4 tokens make a natural trace far more than 32 requests."""
    from sgl_reason.early_stop import EarlyStop

    long = "State the final answer to the following arithmetic problem: 582 + 928 - 904 - 541 ="
    budget = ThinkingBudget(max_thinking_tokens=800, max_answer_tokens=64, mode="two")
    result = think_then_answer(long, budget=budget, backend=reasoner.endpoint,
                               sampling=GREEDY, early_stop=EarlyStop(signal="none", chunk_tokens=4))
    s = result.samples[0]
    assert not s.forced and s.thinking_tokens > 33 * 4, s
    assert s.answer is not None and result.cost.requests > 33


# the two-request route's answer request is the chunked route's (both declare where the thinking
# starts): make test-all runs it
@pytest.mark.parametrize("route", [pytest.param("two", marks=pytest.mark.extended), "chunked"])
def test_every_route_releases_the_thinking(reasoner, route):
    """The two-request route and the chunked route (an early stop ending the thinking) write
    the marker as prompt text: their answer request declares where its thinking starts, and
    release-on-answer frees it as on the single route. The price is one prefill of the
    thinking by the answer request; what the answer reads changes, as release always does."""
    from sgl_reason.early_stop import EarlyStop

    url, b = reasoner.url, reasoner.endpoint
    budget = ThinkingBudget(max_thinking_tokens=400, max_answer_tokens=64, mode="two")
    stop = None
    if route == "chunked":  # stops at the model's check, then asks for the answer
        stop = EarlyStop(signal="probe", chunk_tokens=16, probe_cues=("Check",), probe_agree=1,
                         probe_confidence=0.9, answer_from_probe=False)

    def run(policy):
        before = _metric(url, "sgl_reason:thinking_kv_released_tokens_total")
        result = think_then_answer(QUESTION, budget=budget, backend=b, sampling=GREEDY,
                                   early_stop=stop, kv_policy=policy)
        return result, _metric(url, "sgl_reason:thinking_kv_released_tokens_total") - before

    run("keep")  # the prompt enters the cache
    keep, kept = run("keep")
    release, released = run("release-on-answer")
    assert keep.info["route"] == release.info["route"] == route
    s = release.samples[0]
    assert s.thinking == keep.samples[0].thinking  # the same thinking, released or not
    if route == "chunked":
        assert s.stopped is not None and not s.stopped["answer_from_probe"], s.stopped
    assert kept == 0
    # the thinking as the answer request holds it (re-tokenized text: within a token or two)
    assert abs(released - (s.thinking_tokens - SINK - WINDOW)) <= 2, (released, s)
    # the answer request prefilled the thinking it released; keep's reused it from the cache
    extra = release.cost.computed_prefill_tokens - keep.cost.computed_prefill_tokens
    assert abs(extra - s.thinking_tokens) <= 3, (extra, s.thinking_tokens)
    assert s.answer_tokens > 0
    requests.post(url + "/flush_cache", timeout=30).raise_for_status()
    loads = requests.get(url + "/v1/loads", timeout=10).json()["loads"][0]
    assert loads["num_used_tokens"] == 0  # nothing leaked (strict memory checks are on)
