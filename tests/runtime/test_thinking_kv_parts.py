"""The thinking-KV package's parts without a server: policy arithmetic, freed-column
bookkeeping, scored selection, admission's bound, launch refusals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_reason.runtime.thinking_kv import admission, cache as cache_mod, launch
from sgl_reason.runtime.thinking_kv.columns import FreedColumns, runs
from sgl_reason.runtime.thinking_kv.policy import (
    Policy,
    columns_to_free,
    parse_keep,
    peak_output_kv,
    release_span,
)
from sgl_reason.runtime.thinking_kv.scoring import ScoreBook


def test_keep_parses_as_a_fraction_or_a_token_count():
    assert parse_keep("0.1") == 0.1 and parse_keep("10%") == 0.1 and parse_keep("64") == 64
    assert parse_keep(None) is None and parse_keep("none") is None
    with pytest.raises(ValueError, match="a fraction .* or a token count"):
        parse_keep("a lot")
    for bad in (1.5, -1, True):
        with pytest.raises(ValueError, match="keep must be a fraction in"):
            Policy("release-on-answer", keep=bad)
    with pytest.raises(ValueError, match="score must be one of mean, max"):
        Policy("release-on-answer", keep=0.1, score="sum")
    assert Policy("release-on-answer", keep=0.1).keep_count(95) == 10  # ceil
    assert Policy("release-on-answer", keep=7).keep_count(95) == 7
    assert not Policy("keep", keep=0.1).scored and Policy("release-on-answer", keep=0).scored
    per_request = Policy("keep").override({"thinking_kv_policy": "release-on-answer",
                                           "thinking_kv_keep": 0.25, "thinking_kv_score": "max"})
    assert per_request == Policy("release-on-answer", keep=0.25, score="max")


def test_scored_release_keeps_the_best_scored_middle_columns():
    policy = Policy("release-on-answer", window=4, sink=2, keep=3)
    prompt, marker_at = 10, 20  # thinking = columns 10..29; middle = [12, 26)
    scores = torch.zeros(40)
    scores[[13, 17, 21, 24]] = torch.tensor([5.0, 9.0, 1.0, 7.0])
    freed = columns_to_free(prompt, prompt, marker_at, policy, scores)
    lo, hi = release_span(prompt, prompt, marker_at, policy)
    assert (lo, hi) == (12, 26)
    assert sorted(set(range(lo, hi)) - set(freed.tolist())) == [13, 17, 24]  # the top 3
    # the window-only rule frees the whole middle; no scores: the latest K are kept
    assert freed.tolist() == sorted(freed.tolist())
    assert columns_to_free(prompt, prompt, marker_at, Policy("release-on-answer", window=4,
                                                             sink=2), None).tolist() == list(
        range(12, 26))
    assert columns_to_free(prompt, prompt, marker_at, policy, None).tolist() == list(
        range(12, 23))
    # a tree-owned prefix is never freed, however low it scores
    assert min(columns_to_free(prompt, 20, marker_at, policy, scores).tolist()) >= 20
    assert columns_to_free(prompt, prompt, 5, policy, scores).numel() == 0  # too short


def test_freed_columns_are_never_freed_twice():
    freed, kv = FreedColumns(), SimpleNamespace(req_pool_idx=3)
    freed.add(kv, torch.tensor([5, 6, 7, 10, 12]))
    assert runs(freed.of(kv)) == [(5, 8), (10, 11), (12, 13)]
    # a finish frees [0, 20) and [25, 30): what is left of them
    assert freed.subtract(kv, [(0, 20), (25, 30)]) == [(0, 5), (8, 10), (11, 12), (13, 20),
                                                      (25, 30)]
    assert freed.subtract(SimpleNamespace(req_pool_idx=4), [(0, 4)]) == [(0, 4)]  # another row
    assert freed.of(SimpleNamespace(req_pool_idx=3)) is None  # another request on that lane
    assert freed.of_lane(3) is not None and freed.of_lane(4) is None
    with pytest.raises(ValueError, match="freed twice"):
        freed.add(kv, torch.tensor([7, 8]))
    freed.add(kv, torch.tensor([8, 9]))
    assert freed.count(kv) == 7
    freed.forget(kv, 3)
    assert freed.of(kv) is None and freed.of_lane(3) is None and not freed


def test_score_book_sums_the_last_observed_steps():
    book = ScoreBook(observe=2, reduce="mean")
    for step, length in enumerate((3, 4, 5)):
        book.begin_step(length)
        book.add(torch.full((length,), float(step + 1)), 0)  # one layer
        book.add(torch.full((length,), 1.0), 0)  # another
    # steps 2 and 3 (observe = 2): (2 + 1) + (3 + 1) over their columns
    assert book.scores(5).tolist() == [7.0, 7.0, 7.0, 7.0, 4.0]
    book = ScoreBook(observe=2, reduce="max")
    book.begin_step(2)
    book.add(torch.tensor([0.2, 0.5]), 0)
    book.add(torch.tensor([0.4, 0.1]), 0)
    assert book.scores(3).tolist() == pytest.approx([0.4, 0.5, 0.0])


def test_peak_of_a_scored_request_counts_its_kept_tokens():
    shape = {"budget": 256, "end_ids": [1], "max_answer": 64}
    scored = Policy("release-on-answer", window=16, sink=4, keep=0.25)
    # after release: 4 + 16 + ceil(0.25 * 256) = 84 kept + 1 marker + 64 answer = 149;
    # before it, 256 + 1 + 2 (the marker's observed step, then the step in flight)
    assert peak_output_kv(shape, 400, 32, 32, scored) == 259
    assert peak_output_kv(shape | {"max_answer": 300}, 600, 32, 32, scored) == 385


def _fake_cache(monkeypatch, marker_ids):
    fake = SimpleNamespace(release_ok=True, marker_ids=marker_ids,
                           released_slots=lambda kv: 0)
    monkeypatch.setattr(cache_mod, "_CACHE", fake)


def _req(end_ids, output=0):
    params = {"budget": 96, "end_ids": end_ids, "max_answer": 32}
    req = SimpleNamespace(
        custom_logit_processor="processor", origin_input_ids=[0] * 30, prefix_len=0,
        output_ids=[0] * output, kv=SimpleNamespace(cache_protected_len=30),
        sampling_params=SimpleNamespace(custom_params=params, max_new_tokens=130))
    req._sgl_reason_kv = SimpleNamespace(policy=Policy("release-on-answer"))
    return req


def test_admission_credits_a_release_only_for_the_servers_marker(monkeypatch):
    _fake_cache(monkeypatch, [7])
    assert admission.tokens_to_come(_req([7])) == 98  # max(96 + 1 + 1, 20 + 1 + 32)
    # another marker would never be found by release: no credit
    assert admission.tokens_to_come(_req([8, 9])) is None


def test_running_bound_is_not_discounted_again_by_new_token_ratio(monkeypatch):
    from sglang.srt.managers import schedule_policy

    _fake_cache(monkeypatch, [7])
    admission.install_admission()
    adder = SimpleNamespace(new_token_ratio=0.4)
    offset = schedule_policy.PrefillAdder._get_running_request_total_token_offset
    req = _req([7], output=10)
    req.sampling_params.ignore_eos = False
    # stock: (130 - 10) * 0.4 = 48 < the exact bound 88, so stock's smaller charge stands
    assert offset(adder, req) == pytest.approx(48)
    adder.new_token_ratio = 1.0  # stock 120: the exact bound, 88, with no ratio on it
    assert offset(adder, req) == 88


@pytest.mark.parametrize("change, message", [
    ({"decode_attention_backend": "triton"}, "--decode-attention-backend triton"),
    ({"prefill_attention_backend": "flashinfer"}, "--prefill-attention-backend flashinfer"),
    ({"enable_torch_compile": True}, "--enable-torch-compile"),
    ({"enable_hierarchical_cache": True}, "--enable-hierarchical-cache"),
    ({"disaggregation_mode": "decode"}, "--disaggregation-mode decode"),
    ({"enable_streaming_session": True}, "--enable-streaming-session"),
    ({"device": "cuda", "disable_overlap_schedule": False, "disable_cuda_graph": True},
     "add --disable-overlap-schedule"),
    ({"device": "cuda", "disable_cuda_graph": False, "disable_overlap_schedule": True},
     "add --disable-cuda-graph"),
    ({"attention_backend": "triton"}, "the only one that skips freed columns"),
])
def test_every_path_that_reads_freed_columns_unknowingly_is_refused(change, message):
    base = dict(attention_backend="torch_native", page_size=1, speculative_algorithm=None,
                enable_mixed_chunk=False, device="cpu", disable_overlap_schedule=False)
    assert launch.release_supported(SimpleNamespace(**base)) == []  # CPU: overlap is safe
    problems = launch.release_supported(SimpleNamespace(**(base | change)))
    assert any(message in p for p in problems), problems


def test_observed_rows_are_the_last_thinking_queries_and_the_marker():
    """What decoding observes (the queries of the last ``observe`` thinking tokens and of the
    marker) is what a prefill of a declared thinking observes: the same positions."""
    from sgl_reason.runtime.thinking_kv.policy import ReqState

    st = ReqState(Policy("release-on-answer", keep=0.25, observe=32), think_from=40)
    assert st.observed_rows(3) is None  # the marker is not known yet
    st.marker_col = 140  # thinking [40, 140), marker [140, 143)
    assert st.observed_rows(3) == (111, 143)
    st.marker_col = 50  # a thinking shorter than the window: nothing before it is observed
    assert st.observed_rows(1) == (40, 51)
