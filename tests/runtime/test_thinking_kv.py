"""Thinking-aware KV release, against real SGLang servers (and its arithmetic without one).

Requests are forced to a fixed shape (prompt, exactly T thinking tokens, the marker, exactly A
answer tokens, greedy) by the bench's :class:`Workload`, so token counts can be asserted.
Servers run with SGLang's strict memory checks, which abort the scheduler on any leak.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading

import pytest
import requests

from sgl_reason import EmbeddedRuntime, ServerStartError
from sgl_reason.bench.thinking_kv import STOCK_ENV, Workload, ideal_gain
from sgl_reason.runtime.thinking_kv import Policy, peak_output_kv, release_span

STRICT = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
          "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
T, A = 96, 32  # forced thinking and answer tokens
SINK, WINDOW = 4, 16
RELEASED = T - SINK - WINDOW
FRESH_LOADS = ["--load-snapshot-publish-interval", "1"]  # /v1/loads after every step


# -- no server ----------------------------------------------------------------------------------

def test_release_span_follows_the_range_table():
    policy = Policy("release-on-answer", window=16, sink=4)
    assert release_span(30, 30, 100, policy) == (34, 114)  # [P+S, P+m-W)
    assert release_span(30, 40, 100, policy) == (40, 114)  # never below the tree-owned prefix
    lo, hi = release_span(30, 30, 18, policy)  # thinking shorter than sink + window
    assert hi <= lo


def test_policy_checks_and_request_override():
    with pytest.raises(ValueError, match="Supported: keep, strip, demote, release-on-answer"):
        Policy("drop")
    with pytest.raises(ValueError, match="window must be an integer >= 0"):
        Policy("keep", window=-1)
    base = Policy("keep")
    assert base.override(None) is base and base.override({"budget": 3}) is base
    assert base.override({"thinking_kv_policy": "strip", "thinking_kv_sink": 0}) == Policy(
        "strip", window=base.window, sink=0)


def test_peak_output_kv_of_a_budgeted_request():
    release = Policy("release-on-answer", window=16, sink=4)
    shape = {"budget": 256, "end_ids": [1, 2, 3], "max_answer": 256}
    # thinking up to the release: 256 + 3 + 1 in flight; after it: 4 + 16 kept + 3 + 256
    assert peak_output_kv(shape, 515, 32, 32, release) == 279
    assert peak_output_kv(shape | {"max_answer": 8}, 267, 32, 32, release) == 260
    assert peak_output_kv(shape, 515, 32, 40, release) == 283  # 8 protected + 16 kept
    assert peak_output_kv(shape, 515, 32, 300, release) == 515  # all protected: max_new_tokens
    assert peak_output_kv(shape, 515, 32, 32, Policy("keep")) is None
    assert peak_output_kv({"budget": 256}, 515, 32, 32, release) is None  # shape undeclared


def test_ideal_gain_of_the_default_shape():
    # 256 thinking + 256 answer tokens after a 32-token prompt: about 1.7x (the figure)
    assert 1.6 < ideal_gain(32, 256, 9, 256) < 1.75
    assert ideal_gain(32, 20, 9, 100) == 1.0  # nothing beyond sink + window: nothing released


# -- one server for most tests ------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    with EmbeddedRuntime(extra_args=["--thinking-kv-policy", "keep", "--enable-metrics",
                                     "--max-total-tokens", "1536", *FRESH_LOADS],
                         env=STRICT) as rt:
        yield rt
    assert rt.server.group_pids() == []


@pytest.fixture
def work(server):
    requests.post(server.url + "/flush_cache", timeout=30).raise_for_status()
    return Workload(server.url, (32, T, A), 4)


def _ids(work: Workload, i: int) -> list[int]:
    return work._tokenize(work.prompts[i])


def _generate(url: str, body: dict) -> dict:
    r = requests.post(url + "/generate", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def _generate_together(url: str, bodies: list[dict]) -> list[dict]:
    """``bodies`` as one batched request (one arrival: the same batches on every server)."""
    keys = ("text", "sampling_params", "custom_logit_processor")
    return _generate(url, {"return_logprob": True} | {k: [b[k] for b in bodies] for k in keys})


def _output_ids(out: dict) -> list[int]:
    return [t[1] for t in out["meta_info"]["output_token_logprobs"]]


def _metric(url: str, name: str) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, f"{name} not on /metrics"
    return float(match.group(1))


def _used(url: str) -> int:
    return requests.get(url + "/v1/loads", timeout=10).json()["loads"][0]["num_used_tokens"]


def _cached_after(url: str, ids: list[int]) -> int:
    """How many of ``ids`` the tree still holds (a 1-token request on exactly those ids)."""
    out = _generate(url, {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    return out["meta_info"]["cached_tokens"]


def test_keep_is_token_identical_to_stock(server, work):
    plain = "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n"

    def run(url):
        requests.post(url + "/flush_cache", timeout=30).raise_for_status()
        w = Workload(url, (32, T, A), 2)
        outs = [_generate(url, w.body(i, None)) for i in range(2)]
        outs.append(_generate(url, {"text": plain, "return_logprob": True,
                                    "sampling_params": {"temperature": 0, "max_new_tokens": 40}}))
        ids = [_output_ids(o) for o in outs]
        cached = [_cached_after(url, w._tokenize(w.prompts[i]) + ids[i]) for i in range(2)]
        return ids, cached

    ours = run(server.url)
    with EmbeddedRuntime(extra_args=["--max-total-tokens", "1536"], env=STOCK_ENV) as stock:
        info = requests.get(stock.url + "/get_server_info", timeout=10).json()
        assert info.get("radix_cache_backend") in (None, ""), "the stock server is not stock"
        theirs = run(stock.url)
    assert ours[0] == theirs[0]  # same tokens
    assert ours[1] == theirs[1]  # same cache contents: every generated token stays in the tree


@pytest.mark.parametrize("keep, kept", [(None, 0), (0.25, 24), (10, 10)])
def test_release_frees_thinking_while_the_answer_decodes(server, work, keep, kept):
    """The pool's used size drops by the released count while the request is still running:
    the window-only rule frees all but sink + window; scored retention (a fraction of the 96
    thinking tokens, or a token count) also keeps its best-scored tokens."""
    url, prompt_len = server.url, len(_ids(work, 0))
    marker = len(work.end_ids)
    released_before = _metric(url, "sgl_reason:thinking_kv_released_tokens_total")
    seen = {}
    body = _release_body(work, 0, keep) | {"stream": True}
    with requests.post(url + "/generate", json=body, stream=True, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            n = json.loads(line[5:])["meta_info"]["completion_tokens"]
            if "used" not in seen and n >= T + marker + 8:
                seen.update(n=n, used=_used(url),
                            thinking=_metric(url, "sgl_reason:thinking_kv_tokens"),
                            answer=_metric(url, "sgl_reason:answer_kv_tokens"))
    assert seen, "the stream ended before the answer"
    # used = prompt (locked in the tree) + generated tokens - released, within a step or two
    # (the load snapshot is taken before a step's tokens are processed)
    expected = prompt_len + seen["n"] - (RELEASED - kept)
    assert expected - 3 <= seen["used"] <= expected + 1, (seen, expected)
    assert seen["thinking"] == SINK + WINDOW + kept and seen["answer"] >= marker + 6, seen
    released = _metric(url, "sgl_reason:thinking_kv_released_tokens_total") - released_before
    assert released == RELEASED - kept
    # and with keep, nothing is released: used follows the generated tokens
    out = _generate(url, work.body(1, "keep"))
    assert out["meta_info"]["completion_tokens"] == T + marker + A
    assert (_metric(url, "sgl_reason:thinking_kv_released_tokens_total") - released_before
            == RELEASED - kept)


def _release_body(work: Workload, i: int, keep) -> dict:
    body = work.body(i, "release-on-answer")
    if keep is not None:
        body["sampling_params"]["custom_params"]["thinking_kv_keep"] = keep
    return body


def _declared_body(input_ids: list[int], start: int, params: dict, stream=False) -> dict:
    return {"input_ids": input_ids, "return_logprob": True, "stream": stream,
            "sampling_params": {"temperature": 0, "max_new_tokens": A, "ignore_eos": True,
                                "custom_params": {"thinking_start": start, **params}}}


@pytest.mark.parametrize("keep, kept", [(None, 0), (0.25, 24)])
def test_a_prompt_that_holds_its_thinking_releases_it(server, work, keep, kept):
    """The declared route (the answer request of the two-request and chunked routes): the
    prompt holds the thinking and the marker, ``thinking_start`` says where the thinking
    starts. Its prefix match stops there although the tree holds the whole thinking (a keep
    request put it there), the thinking is prefilled into the request's own columns, observed
    inside that prefill (scored retention) and released after the first decode step: the
    pool's used size drops by the released count while the answer decodes."""
    url, prompt = server.url, _ids(work, 0)
    marker = len(work.end_ids)
    kept_out = _output_ids(_generate(url, work.body(0, "keep")))
    ids = prompt + kept_out[:T + marker]
    params = {"thinking_kv_policy": "release-on-answer"}
    if keep is not None:
        params["thinking_kv_keep"] = keep
    released_before = _metric(url, "sgl_reason:thinking_kv_released_tokens_total")
    seen, meta = {}, None
    with requests.post(url + "/generate", json=_declared_body(ids, len(prompt), params, True),
                       stream=True, timeout=600) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            meta = json.loads(line[5:])["meta_info"]
            if "used" not in seen and meta["completion_tokens"] >= 8:
                seen.update(n=meta["completion_tokens"], used=_used(url),
                            thinking=_metric(url, "sgl_reason:thinking_kv_tokens"))
    assert meta["cached_tokens"] <= len(prompt)  # matched no further than the thinking
    expected = len(ids) + seen["n"] - (RELEASED - kept)
    assert expected - 3 <= seen["used"] <= expected + 1, (seen, expected)
    assert seen["thinking"] == SINK + WINDOW + kept, seen
    released = _metric(url, "sgl_reason:thinking_kv_released_tokens_total") - released_before
    assert released == RELEASED - kept
    if keep is not None:
        assert "scores from 32 observed prefill rows" in server.server.tail(400)
    # the released request did not enter the tree: past the thinking, the tree holds only
    # the keep request's answer, shared for as long as the two answers agree
    answer = _output_ids({"meta_info": meta})
    same = next((i for i, (a, b) in enumerate(zip(answer, kept_out[T + marker:])) if a != b),
                len(answer))
    assert same < len(answer) - 4  # releasing changed this model's answer: a real check
    assert _cached_after(url, ids + answer) <= len(ids) + same


def test_a_declared_thinking_without_the_marker_is_a_400(server, work):
    prompt = _ids(work, 0)
    for start, message in ((len(prompt) - 5, "no end-of-thinking marker"),
                           (10 ** 6, "an integer in [0,"), ("3", "an integer in [0,")):
        r = requests.post(server.url + "/generate", timeout=60, json=_declared_body(
            prompt, start, {"thinking_kv_policy": "release-on-answer"}))
        assert r.status_code == 400 and message in r.text, r.text


def test_no_released_request_reads_a_freed_column(server, work):
    """Freed columns point at slot 0. On a server whose slot 0 holds NaN keys and huge values,
    released requests (window-only and scored), batched with a kept one, still produce exactly
    the tokens they produce on a clean server: no freed column is ever read."""
    bodies = [_release_body(work, 0, None), _release_body(work, 1, 0.25),
              _release_body(work, 2, 0.5), work.body(3, "keep")]
    clean = [_output_ids(o) for o in _generate_together(server.url, bodies)]
    env = STRICT | {"SGL_REASON_POISON_PADDING_SLOT": "1"}
    with EmbeddedRuntime(extra_args=["--thinking-kv-policy", "keep", "--max-total-tokens",
                                     "1536"], env=env) as rt:
        assert "KV slot 0 poisoned" in rt.server.tail(200)
        poisoned = [_output_ids(o) for o in _generate_together(rt.url, bodies)]
        # the scored release read its scores from the attention of its last 32 steps
        assert "scores from 32 observed steps" in rt.server.tail(400)
    assert rt.server.group_pids() == []
    assert poisoned == clean

@pytest.mark.parametrize("policy,keeps_output", [("keep", True), ("strip", False),
                                                 ("release-on-answer", False)])
def test_what_stays_in_the_tree(server, work, policy, keeps_output):
    out = _generate(server.url, work.body(0, policy))
    prompt, output = _ids(work, 0), _output_ids(out)
    assert len(output) == T + len(work.end_ids) + A
    cached = _cached_after(server.url, prompt + output)
    if keeps_output:
        assert cached >= len(prompt) + len(output) - 2
    else:  # the prompt stays, nothing of the thinking or the answer
        assert len(prompt) - 2 <= cached <= len(prompt)


def test_mixed_load_of_releases_forks_and_aborts_leaks_nothing(server, work):
    url = server.url
    marker = len(work.end_ids)
    shared = work.prompts[0]
    _generate(url, {"text": shared, "sampling_params": {"max_new_tokens": 0}})  # fork's commit
    results, errors = {}, []

    def run(name, body):
        try:
            results[name] = _generate(url, body)
        except AssertionError as error:
            errors.append(error)

    def run_and_abort(name, body):
        body = body | {"stream": True, "rid": name}
        with requests.post(url + "/generate", json=body, stream=True, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith(b"data:") and line != b"data: [DONE]":
                    n = json.loads(line[5:])["meta_info"]["completion_tokens"]
                    if n >= T + marker + 4:  # released, answering
                        requests.post(url + "/abort_request", json={"rid": name}, timeout=30)
                        break
        results[name] = "aborted"

    jobs = [("fork0", run, work.body(0, "release-on-answer")),
            ("fork1", run, work.body(0, "release-on-answer")),
            ("fork2", run, work.body(0, "strip")),
            ("other", run, work.body(1, "release-on-answer")),
            ("keep", run, work.body(2, "keep")),
            ("abort0", run_and_abort, work.body(3, "release-on-answer")),
            ("abort1", run_and_abort, work.body(1, "release-on-answer"))]
    threads = [threading.Thread(target=fn, args=(name, body)) for name, fn, body in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == len(jobs)
    for name in ("fork0", "fork1", "fork2", "other", "keep"):
        meta = results[name]["meta_info"]
        assert meta["completion_tokens"] == T + marker + A, name
    for name in ("fork0", "fork1", "fork2"):  # the branches read the committed prefix
        assert results[name]["meta_info"]["cached_tokens"] >= len(_ids(work, 0)) - 2
    # no branch's release touched the shared prompt's KV
    assert _cached_after(url, _ids(work, 0)) >= len(_ids(work, 0)) - 1
    requests.post(url + "/flush_cache", timeout=30).raise_for_status()
    loads = requests.get(url + "/v1/loads", timeout=10).json()["loads"][0]
    assert loads["num_used_tokens"] == 0 and loads["num_running_reqs"] == 0
    assert requests.get(url + "/health", timeout=10).status_code == 200  # strict checks passed
    assert "leak" not in server.server.tail(60).lower()


def test_demote_on_a_server_without_priority_eviction_is_refused(server):
    """demote orders eviction by node priority; this server evicts by LRU, where a demoted
    node would be an ordinary one: a 400 that says so, not a silent no-op."""
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2,
                                              "custom_params": {"thinking_kv_policy": "demote"}}}
    r = requests.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 400 and "--radix-eviction-policy priority" in r.text


def test_bad_request_override_is_refused_with_the_fix(server):
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2,
                                              "custom_params": {"thinking_kv_policy": "drop"}}}
    r = requests.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 400 and "Supported: keep, strip, demote, release-on-answer" in r.text
    body["sampling_params"]["custom_params"] = {"thinking_kv_window": -3}
    r = requests.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 400 and "window must be an integer >= 0" in r.text


@pytest.mark.parametrize("params, message", [
    ({"budget": "64", "end_ids": [1], "max_answer": 4}, "budget must be an integer >= 0"),
    ({"budget": 8, "end_ids": [10 ** 9], "max_answer": 4}, "end_ids must be a non-empty list"),
    ({"budget": 8, "end_ids": [1], "max_answer": -2}, "max_answer must be an integer >= 1"),
])
def test_bad_budget_params_are_a_400_not_a_scheduler_crash(server, params, message):
    """The processor's own params, checked before scheduling: a wrong type or an id past the
    vocabulary would otherwise raise inside the scheduler's sampling step."""
    from sgl_reason.programs.budget import BudgetForcingProcessor

    body = {"text": "Hi", "custom_logit_processor": BudgetForcingProcessor.to_str(),
            "sampling_params": {"max_new_tokens": 4, "custom_params": params}}
    r = requests.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 400 and message in r.text
    ok = requests.post(server.url + "/generate", timeout=60,
                       json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert ok.json()["meta_info"]["completion_tokens"] == 2  # the server serves on


@pytest.mark.parametrize("prompt", [{"text": ""}, {"input_ids": []}])
def test_an_empty_prompt_is_a_400_not_a_dead_server(server, prompt):
    """SGLang 0.5.23 refuses empty input_ids, but text that tokenizes to nothing reaches the
    scheduler, which, given it alone, dies in its rotary embedding and takes the server down
    (found by the soak); the plugin refuses it at admission."""
    r = requests.post(server.url + "/generate", timeout=60,
                      json={**prompt, "sampling_params": {"max_new_tokens": 8}})
    assert r.status_code == 400 and "empty" in r.text
    ok = requests.post(server.url + "/generate", timeout=60,
                       json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert ok.json()["meta_info"]["completion_tokens"] == 2  # the server serves on


def test_admission_reserves_a_released_requests_peak_not_its_max_new_tokens(server, work):
    """Eight budgeted requests reach an idle server in one message (one admission round).
    Stock admission charges each its prompt + max_new_tokens (230): 6 fit the 1,536-token pool.
    Under release-on-answer each is charged its real peak (prompt + 121): all 8 fit."""
    url, n, shape = server.url, 8, (32, 96, 96)
    w = Workload(url, shape, n)
    ids = [w._tokenize(p) for p in w.prompts]
    lines: list[str] = []
    stock_sink = server.server.log_sink

    def first_prefill(policy: str) -> int:
        requests.post(url + "/flush_cache", timeout=30).raise_for_status()
        bodies = [w.body(i, policy) for i in range(n)]
        lines.clear()
        out = _generate(url, {"input_ids": ids,  # token ids: SGLang sends the batch as one
                              "sampling_params": [b["sampling_params"] for b in bodies],
                              "custom_logit_processor": [b["custom_logit_processor"]
                                                         for b in bodies]})
        assert [o["meta_info"]["completion_tokens"] for o in out] == [
            shape[1] + len(w.end_ids) + shape[2]] * n
        first = next(line for line in lines if "Prefill batch" in line)
        return int(re.search(r"#new-seq: (\d+)", first).group(1))

    server.server.log_sink = lambda line: (lines.append(line), stock_sink and stock_sink(line))
    try:
        keep, release = first_prefill("keep"), first_prefill("release-on-answer")
    finally:
        server.server.log_sink = stock_sink
    assert keep < n and release == n, (keep, release)


# -- demote on its own server (priority eviction) -----------------------------------------------

def test_demote_evicts_the_output_before_older_nodes():
    with EmbeddedRuntime(extra_args=["--thinking-kv-policy", "demote", "--max-total-tokens",
                                     "512"], env=STRICT) as rt:
        w = Workload(rt.url, (32, 80, 20), 3)
        older = _generate(rt.url, w.body(0, "keep"))  # least recently used, not demoted
        demoted = _generate(rt.url, w.body(1, None))  # the server's policy: demote
        # a longer request that does not fit beside both: something must be evicted
        big = Workload(rt.url, (32, 200, 20), 3)
        _generate(rt.url, big.body(2, "keep"))
        older_ids = _ids(w, 0) + _output_ids(older)
        demoted_ids = _ids(w, 1) + _output_ids(demoted)
        assert _cached_after(rt.url, older_ids) >= len(older_ids) - 2  # LRU would drop this
        assert _cached_after(rt.url, demoted_ids) <= len(_ids(w, 1))  # only its prompt is left


# -- launch-time errors -------------------------------------------------------------------------

@pytest.mark.parametrize("flags,message", [
    (["--thinking-kv-policy", "drop"], "invalid choice: 'drop'"),
    (["--thinking-kv-policy", "release-on-answer", "--thinking-kv-window", "9000"],
     "no thinking could ever be released"),
    (["--radix-cache-backend", "sgl-reason", "--think-end", " "], "No end-of-thinking marker"),
    (["--thinking-kv-policy", "release-on-answer", "--page-size", "4"],
     "it needs --page-size 1. Supported elsewhere: keep, strip, demote"),
])
def test_bad_flags_fail_at_launch_with_the_fix(flags, message):
    from sgl_reason.model import default_model_path

    proc = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(default_model_path()),
         "--device", "cpu", "--attention-backend", "torch_native", *flags],
        capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout


def test_serve_refuses_a_window_larger_than_the_context():
    with pytest.raises(ServerStartError, match="no thinking could ever be released"):
        EmbeddedRuntime(extra_args=["--thinking-kv-window", "8190"]).start()


# -- release under pressure (its own small pool) ------------------------------------------------

PRESSURE_METRICS = ("thinking_kv_pressure_releases", "thinking_kv_released_tokens",
                    "retracted_requests")


def _small_pool(pool: int, env: dict | None = None) -> EmbeddedRuntime:
    return EmbeddedRuntime(extra_args=["--thinking-kv-policy", "keep", "--enable-metrics",
                                       "--max-total-tokens", str(pool), *FRESH_LOADS],
                           env=STRICT | (env or {}))


def _pressure_rows(rt, policies: tuple[str, ...]) -> list[tuple]:
    """Four 32/96/32 requests at once per policy: each row is their output ids and how much
    each of PRESSURE_METRICS grew."""
    rows = []
    w = Workload(rt.url, (32, T, A), 4)
    ids = [w._tokenize(p) for p in w.prompts]
    for policy in policies:
        before = [_metric(rt.url, f"sgl_reason:{name}_total") for name in PRESSURE_METRICS]
        bodies = [w.body(i, policy) for i in range(4)]
        out = _generate(rt.url, {
            "input_ids": ids, "return_logprob": True,
            "sampling_params": [b["sampling_params"] for b in bodies],
            "custom_logit_processor": [b["custom_logit_processor"] for b in bodies]})
        after = [_metric(rt.url, f"sgl_reason:{name}_total") for name in PRESSURE_METRICS]
        assert all(len(_output_ids(o)) == T + len(w.end_ids) + A for o in out)
        rows.append(([_output_ids(o) for o in out], *(b - a for a, b in zip(before, after))))
        requests.post(rt.url + "/flush_cache", timeout=30).raise_for_status()
        assert _used(rt.url) == 0
    return rows


def test_release_on_pressure_frees_only_when_decode_would_not_fit(server):
    """Four 32/96/32 requests need ~4 x 161 slots at their peak. On the module's 1,536-token
    pool nothing is short: release-on-pressure frees nothing and its tokens are keep's. On a
    pool that holds about three of them at their peak (admission credits the release, as for
    release-on-answer), decode runs short while they answer: thinking KV is freed, lowest score
    first, instead of a retraction."""
    requests.post(server.url + "/flush_cache", timeout=30).raise_for_status()
    roomy_keep, roomy = _pressure_rows(server, ("keep", "release-on-pressure"))
    assert roomy[1:] == (0, 0, 0) and roomy[0] == roomy_keep[0]  # nothing short: keep's tokens
    with _small_pool(560) as rt:
        (tight,) = _pressure_rows(rt, ("release-on-pressure",))
    assert tight[1] > 0 and 0 < tight[2] <= 4 * RELEASED and tight[3] == 0, tight[1:]


@pytest.mark.extended
def test_a_retracted_mixed_load_is_released_again_and_leaks_nothing(server):
    """On the same small pool, SGLang's own test switch retracts a request every 25 steps:
    every kind of request at once (keep and forks of one prompt, release-on-pressure, declared
    thinking released at once, two aborted while answering) comes back whole, is re-prefilled
    and released again, and every slot comes back under SGLang's strict checks."""
    requests.post(server.url + "/flush_cache", timeout=30).raise_for_status()
    ((thoughts, *_),) = _pressure_rows(server, ("keep",))  # each one's thinking, then answer
    with _small_pool(560, {"SGLANG_TEST_RETRACT": "1",
                           "SGLANG_TEST_RETRACT_INTERVAL": "25"}) as rt:
        w = Workload(rt.url, (32, T, A), 4)
        ids = [w._tokenize(p) for p in w.prompts]
        retracted = _metric(rt.url, "sgl_reason:retracted_requests_total")
        marker = len(w.end_ids)
        assert all(t[T:T + marker] == w.end_ids for t in thoughts)
        declared = [_declared_body(ids[i] + thoughts[i][:T + marker], len(ids[i]),
                                   {"thinking_kv_policy": "release-on-answer"}) for i in (1, 2)]
        jobs = [("fork0", w.body(0, "keep")), ("fork1", w.body(0, "keep")),
                ("keep", w.body(3, "keep")), ("pressure", w.body(1, "release-on-pressure")),
                ("declared0", declared[0]), ("declared1", declared[1]),
                ("abort0", w.body(2, "release-on-answer") | {"stream": True, "rid": "abort0"}),
                ("abort1", declared[0] | {"stream": True, "rid": "abort1"})]
        results = {}

        def go(name, body):
            if not body.get("stream"):
                results[name] = _generate(rt.url, body)["meta_info"]["completion_tokens"]
                return
            with requests.post(rt.url + "/generate", json=body, stream=True, timeout=600) as r:
                for line in r.iter_lines():
                    if line.startswith(b"data:") and line != b"data: [DONE]":
                        n = json.loads(line[5:])["meta_info"]["completion_tokens"]
                        if n >= (T + marker + 4 if name == "abort0" else 4):  # released
                            requests.post(rt.url + "/abort_request", json={"rid": name},
                                          timeout=30)
                            break
            results[name] = "aborted"

        threads = [threading.Thread(target=go, args=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        full = T + marker + A
        assert results == {"fork0": full, "fork1": full, "keep": full, "pressure": full,
                           "declared0": A, "declared1": A, "abort0": "aborted",
                           "abort1": "aborted"}, results
        rt.flush_cache()  # waits for the aborted requests to finish
        assert _used(rt.url) == 0 and "leak" not in rt.server.tail(80).lower()
        assert _metric(rt.url, "sgl_reason:retracted_requests_total") - retracted >= 3
