"""Best-of-N against the real server: verifiers, tie-break, prefix reuse."""

from __future__ import annotations

import threading

import pytest

from sgl_reason.programs import Sample, best_of_n
from sgl_reason.programs.best_of_n import pick_best

QUESTION = "Tom has 3 boxes with 4 apples each. He eats 2 apples. How many apples are left?"


@pytest.mark.server
def test_sgl_function_verifier_reuses_the_candidates_prefix(fresh_cache):
    result = best_of_n(QUESTION, n=3, max_tokens=24, backend=fresh_cache.endpoint)
    scores = [s.score for s in result.samples]
    assert all(0.0 < x < 1.0 for x in scores)
    assert result.info["best_index"] == pick_best(result.samples)
    assert scores[result.info["best_index"]] == max(scores)
    # verifier requests run on each candidate's state: prompt + candidate come from the cache,
    # only the verifier's own question (~20 tokens) and choice tokens are prefilled
    prompt = result.cost.prompt_tokens  # upper bound on any single prompt
    computed = result.cost.computed_prefill_tokens
    first_prompt = 60  # the question's chat prompt is about 55 tokens
    assert computed <= first_prompt + 3 * (24 + 40), (computed, prompt)


@pytest.mark.server
def test_callable_verifier_picks_the_best_score(runtime):
    result = best_of_n(QUESTION, n=3, max_tokens=16, backend=runtime.endpoint,
                       verifier=lambda q, c: float(len(c)))
    lengths = [len(s.text) for s in result.samples]
    assert result.info["best_index"] == lengths.index(max(lengths))


@pytest.mark.server
def test_a_verifier_that_raises_leaves_no_branch_thread_behind(runtime):
    # Each fork runs an SGLang executor on a non-daemon thread that waits for more work until
    # it is ended. A program that fails after its branches finished must end them itself: its
    # exception's frames hold the branches (in a gateway's log record, a reference cycle, or
    # at interpreter exit, which joins non-daemon threads before it collects cycles, so a CLI
    # interrupted mid-eval hung there), and n idle threads outlive every failed call.
    def broken(question, candidate):
        raise RuntimeError("the verifier is broken")

    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="verifier is broken") as caught:
        best_of_n(QUESTION, n=2, max_tokens=4, backend=runtime.endpoint, verifier=broken)
    new = [t for t in threading.enumerate() if t not in before]
    for thread in new:
        thread.join(timeout=10)
    assert [t for t in new if t.is_alive()] == [], caught.value  # while the error is held


def _s(answer, score):
    return Sample(text="", answer_text="", answer=answer, score=score)


def test_tie_break_score_then_support_then_order():
    assert pick_best([_s("1", 0.2), _s("2", 0.9), _s("3", 0.5)]) == 1
    # equal scores: the answer more candidates agree on wins
    assert pick_best([_s("1", 0.5), _s("2", 0.5), _s("2", 0.1)]) == 1
    # equal scores and support: the earliest
    assert pick_best([_s("1", 0.5), _s("2", 0.5)]) == 0
    assert pick_best([_s(None, None), _s("2", 0.0)]) == 1


def test_bad_verifier():
    with pytest.raises(TypeError, match="verifier must be an @sgl.function"):
        best_of_n(QUESTION, verifier="yes", backend=object())
