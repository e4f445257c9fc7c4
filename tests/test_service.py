"""The gateway driven by the official ``openai`` client against the real reasoner server."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import requests

from sgl_reason.service import Gateway, Service, ServiceConfig, _Splitter

QUESTION = "State the final answer to the following arithmetic problem: 37 + 48 - 21 ="
LONG_QUESTION = "Calculate 84 * 97 - 65 * 38 + 29 * 76."
SHORT = {"max_thinking_tokens": 48}

# a client that leaves mid-stream cancels its program: no exception may escape SGLang's program
# thread (it would print a traceback into the gateway's log for every client that leaves)
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")


def test_the_splitter_finds_a_marker_split_across_chunks():
    s = _Splitter("\n</think>\n\n")
    out = []
    for piece in ["Let me add. 3", "7 + 4", "8 = 85.\n</th", "ink>\n\nThe answer", " is 85."]:
        out += s.feed(piece)
    out += s.flush()
    reasoning = "".join(p for k, p in out if k == "reasoning_content")
    content = "".join(p for k, p in out if k == "content")
    assert reasoning == "Let me add. 37 + 48 = 85." and content == "The answer is 85."


def test_a_default_answer_above_the_limit_is_refused():
    with pytest.raises(ValueError, match="default_answer_tokens"):
        ServiceConfig(max_answer_tokens=64)


def test_the_cli_flags_are_the_config_fields():
    from sgl_reason.cli import build_parser

    args = build_parser().parse_args(["gateway"])
    assert ServiceConfig(**{k: getattr(args, k) for k in ServiceConfig.model_fields}) == \
        ServiceConfig()


@pytest.fixture(scope="module")
def gateway(reasoner):
    service = Service(reasoner.endpoint, ServiceConfig(max_n=8, max_answer_tokens=256,
                                                         default_answer_tokens=64),
                      "reasoner")
    with Gateway(service) as g:
        yield g, service, reasoner


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway[0].url + "/v1", api_key="unused", max_retries=0)


def _used(url: str) -> int:
    return requests.get(url + "/v1/loads", timeout=10).json()["loads"][0]["num_used_tokens"]


def _wait_free(url: str, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while (used := _used(url)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return used


@pytest.mark.server
def test_plain_reply_separates_reasoning_and_carries_the_ledger(client):
    r = client.chat.completions.create(model="reasoner", messages=[
        {"role": "user", "content": QUESTION}], max_tokens=64, temperature=0, extra_body=SHORT)
    message = r.choices[0].message
    assert message.content and message.reasoning_content
    assert "</think>" not in message.reasoning_content  # split at the (first) marker
    extra = r.model_extra
    ledger = r.usage.model_extra["sgl_reason"]
    assert extra["thinking_budget"] == 48 and r.choices[0].model_extra["thinking_tokens"] <= 48
    assert ledger["requests"] == 1 and ledger["thinking_tokens"] <= 48
    assert r.usage.completion_tokens >= ledger["thinking_tokens"] + ledger["answer_tokens"]
    assert r.usage.prompt_tokens == ledger["cached_tokens"] + ledger["computed_prefill_tokens"]
    assert [m.id for m in client.models.list().data] == ["reasoner"]


@pytest.mark.server
def test_streamed_reply_is_the_plain_reply_in_pieces(client):
    kw = dict(model="reasoner", messages=[{"role": "user", "content": QUESTION}],
              max_tokens=64, temperature=0, extra_body=SHORT)
    whole = client.chat.completions.create(**kw)
    reasoning, content, last = [], [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        last = chunk
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
            content.append(delta.content or "")
    assert len([x for x in reasoning + content if x]) > 3  # it came in pieces
    assert "".join(content).strip() == whole.choices[0].message.content
    assert "".join(reasoning).strip() == whole.choices[0].message.reasoning_content
    ledger = last.usage.model_extra["sgl_reason"]
    assert ledger["thinking_tokens"] == whole.usage.model_extra["sgl_reason"]["thinking_tokens"]


@pytest.mark.server
def test_n4_votes_over_samples_that_share_one_prefill(client):
    r = client.chat.completions.create(model="reasoner", n=4, messages=[
        {"role": "user", "content": QUESTION}], max_tokens=64,
        extra_body={**SHORT, "min_p": 0.1})
    assert len(r.choices) == 5  # the voted answer, then the four samples
    vote = r.model_extra["vote"]
    answers = [c.model_extra["answer"] for c in r.choices[1:]]
    assert vote["voter"] == "exact" and vote["samples"] == 4
    assert r.choices[0].model_extra["answer"] == vote["answer"]
    assert vote["answer"] is None or vote["answer"] in answers
    ledger = r.usage.model_extra["sgl_reason"]
    prompt = r.usage.prompt_tokens
    # one prefill of the prompt: the four branches are served from the cache
    assert ledger["computed_prefill_tokens"] < prompt / 2


@pytest.mark.server
@pytest.mark.parametrize("effort", ["low", "medium", "high"])
def test_each_tier_gets_its_budget_within_the_context(client, gateway, effort):
    service = gateway[1]
    r = client.chat.completions.create(model="reasoner", reasoning_effort=effort, messages=[
        {"role": "user", "content": QUESTION}], max_tokens=64, temperature=0)
    room = service._room([{"role": "user", "content": QUESTION}], 64)
    tier = {"low": 4096, "medium": 16384, "high": 65536}[effort]
    assert r.model_extra["thinking_budget"] == min(tier, room) and room < 16384
    assert r.choices[0].message.content


@pytest.mark.server
def test_early_stop_per_request(client):
    r = client.chat.completions.create(model="reasoner", messages=[
        {"role": "user", "content": QUESTION}], max_tokens=64, temperature=0,
        extra_body={"max_thinking_tokens": 256,
                    "early_stop": {"signal": "probe", "chunk_tokens": 32}})
    assert r.choices[0].model_extra["thinking_tokens"] <= 256
    assert r.usage.model_extra["sgl_reason"]["requests"] > 1  # chunks and probes


@pytest.mark.server
def test_a_client_that_leaves_mid_stream_frees_the_servers_kv(gateway, client):
    g, _, reasoner = gateway
    body = {"model": "reasoner", "stream": True, "max_tokens": 64,
            "messages": [{"role": "user", "content": QUESTION}], "max_thinking_tokens": 1024}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", g.url + "/v1/chat/completions", json=body) as r:
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data:"):
                    seen += 1
                if seen >= 4:
                    assert _used(reasoner.url) > 0  # the request holds KV now
                    break
    assert _wait_free(reasoner.url) == 0  # aborted: every slot back
    text = requests.get(g.url + "/metrics", timeout=10).text
    assert 'sgl_reason_service_requests_total{status="499",tier="custom"}' in text
    r = client.chat.completions.create(model="reasoner", messages=[
        {"role": "user", "content": QUESTION}], max_tokens=16, extra_body=SHORT)
    assert r.choices[0].message.content is not None  # still serving


@pytest.mark.server
@pytest.mark.parametrize("fields,status,words", [
    ({"n": 0}, 400, "n must be between 1 and 8"),
    ({"n": 99}, 400, "n must be between 1 and 8"),
    ({"max_tokens": 5000}, 400, "exceeds this service's 256"),
    ({"max_thinking_tokens": 100000}, 400, "exceeds this service's limit"),
    ({"max_thinking_tokens": 60000}, 400, "does not fit"),
    ({"max_thinking_tokens": 0}, 400, "max_thinking_tokens"),
    ({"reasoning_effort": "extreme"}, 400, "reasoning_effort"),
    ({"temperature": -1}, 400, "temperature"),
    ({"min_p": 1.5}, 400, "min_p"),
    ({"thinking_kv_policy": "forget"}, 400, "release-on-answer"),
    ({"early_stop": {"signal": "psychic"}}, 400, "early_stop"),
    ({"early_stop": {"signal": "probe", "chunk": 8}}, 400, "early_stop"),
    ({"early_stop": {"signal": "consensus"}}, 400, "n > 1"),
    ({"vote": {"method": "loudest"}}, 400, "vote"),
    ({"n": 2, "vote": {"weigh": "confidence"}, "early_stop": {"signal": "entropy"}}, 400,
     "use early_stop confidence or consensus"),
    ({"n": 2, "stream": True}, 400, "stream with n > 1"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, 400, "last message"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "role 'tool'"),
    ({"messages": [{"role": "user", "content": 3}]}, 400, "content"),
    ({"messages": []}, 400, "last message"),
    ({"model": "gpt-5"}, 404, "not served here"),
])
def test_bad_input_is_a_4xx_that_names_the_fix(gateway, fields, status, words):
    g = gateway[0]
    body = {"model": "reasoner", "messages": [{"role": "user", "content": QUESTION}], **fields}
    r = requests.post(g.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"], r.json()


@pytest.mark.server
def test_a_body_that_is_not_json(gateway, client):
    r = requests.post(gateway[0].url + "/v1/chat/completions", data=b"{nope", timeout=10)
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="n must be"):
        client.chat.completions.create(model="reasoner", n=100, messages=[
            {"role": "user", "content": QUESTION}])


@pytest.mark.server
def test_limits_429_past_concurrency_and_504_past_the_timeout(reasoner):
    body = {"model": "reasoner", "messages": [{"role": "user", "content": QUESTION}],
            "max_thinking_tokens": 2048, "max_tokens": 64}
    # A generous timeout while one stream is held: on a slow machine a 2 s timeout can free
    # the held slot before the second request arrives, which then meets the timeout (504).
    busy = Service(reasoner.endpoint, ServiceConfig(max_concurrency=1, timeout_s=300),
                   "reasoner")
    # The held stream must outlast the second request's admission on a loaded machine: greedy,
    # LONG_QUESTION thinks about 1,030 tokens (80-95 s here; QUESTION's ~200 once ended first on
    # CI). Leaving the stream cancels it, so the length costs the suite nothing.
    long = {**body, "messages": [{"role": "user", "content": LONG_QUESTION}], "stream": True,
            "temperature": 0}
    with Gateway(busy) as g:
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", g.url + "/v1/chat/completions", json=long) as held:
                lines = held.iter_lines()
                seen = []
                for line in lines:  # until the model is thinking upstream
                    seen.append(line)
                    if "reasoning_content" in line:
                        break
                assert busy.in_flight == 1, seen
                sent = time.monotonic()
                r = requests.post(g.url + "/v1/chat/completions", json=body, timeout=60)
                if r.status_code != 429:  # say why the held slot was free
                    rest = [x[:300] for x in lines if x][-3:]
                    pytest.fail(f"got {r.status_code} after {time.monotonic() - sent:.1f} s, "
                                f"{busy.in_flight} in flight; the held stream's last events: "
                                f"{rest}")
                assert "retry later" in r.json()["error"]["message"]
        assert 'status="429"' in requests.get(g.url + "/metrics", timeout=10).text
        deadline = time.monotonic() + 30
        while busy.in_flight and time.monotonic() < deadline:  # the left stream's slot
            time.sleep(0.1)
        assert busy.in_flight == 0
    assert _wait_free(reasoner.url) == 0

    hasty = Service(reasoner.endpoint, ServiceConfig(max_concurrency=1, timeout_s=2),
                    "reasoner")
    with Gateway(hasty) as g:
        r = requests.post(g.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 504 and "timeout" in r.json()["error"]["message"]
        assert _wait_free(reasoner.url) == 0  # the timed-out request was aborted
        assert 'status="504"' in requests.get(g.url + "/metrics", timeout=10).text
