"""ReasonBackend against the real server: token-exact continuation of a trace made in pieces, the
streamed cost, and a cache flush that waits for the server to be idle."""

from __future__ import annotations

import pytest
import sglang as sgl

from sgl_reason.backend import _IDS_VAR, OUTPUT_IDS_KEY

PROMPT = "Count slowly from one to one hundred, one number per line:\n"


@sgl.function
def two_pieces(s):
    # ignore_eos: every piece ends on its length, the case whose ids continue the trace (after
    # an EOS the text is re-tokenized; the greedy text here reached EOS at token 8 of "b" once
    # the extend attention moved to fp32)
    s += PROMPT
    s += sgl.gen("a", max_tokens=8, temperature=0, ignore_eos=True)
    s += sgl.gen("b", max_tokens=8, temperature=0, ignore_eos=True)
    s += " and then"
    s += sgl.gen("c", max_tokens=4, temperature=0, ignore_eos=True)


@pytest.mark.server
def test_a_trace_in_pieces_continues_the_models_own_tokens(fresh_cache):
    backend = fresh_cache.endpoint.scoped()
    state = two_pieces.run(backend=backend)
    prompt_ids = backend.tokenize(PROMPT, add_special_tokens=True)
    out = {k: state.get_meta_info(k)[OUTPUT_IDS_KEY] for k in "abc"}
    assert [len(out[k]) for k in "abc"] == [8, 8, 4]  # each piece ended on its length
    text, ids = state.stream_executor.variables[_IDS_VAR]
    assert text == state.text()
    # the server saw the model's own ids, never a re-tokenization of the decoded text
    assert ids == prompt_ids + out["a"] + out["b"] + backend.tokenize(" and then") + out["c"]
    meta_b, meta_c = state.get_meta_info("b"), state.get_meta_info("c")
    assert meta_b["prompt_tokens"] == len(prompt_ids) + 8
    assert meta_b["cached_tokens"] == len(prompt_ids) + 7  # the seam is exactly one token
    n_then = len(backend.tokenize(" and then"))
    assert meta_c["prompt_tokens"] == len(prompt_ids) + 16 + n_then
    assert meta_c["cached_tokens"] == len(prompt_ids) + 15
    cost = backend.recorder.snapshot()
    assert cost.computed_prefill_tokens == len(prompt_ids) + 1 + (1 + n_then)


@sgl.function
def one_answer(s):
    s += PROMPT
    s += sgl.gen("a", max_tokens=12, temperature=0)


@pytest.mark.server
def test_a_plain_function_streams_and_its_cost_is_recorded_when_the_stream_ends(runtime):
    """stream=True works as on RuntimeEndpoint (text_iter and async iteration), with the same
    greedy text as a whole request, and the ledger gets the server's counts once."""
    import asyncio

    whole = one_answer.run(backend=runtime.endpoint.scoped())
    backend = runtime.endpoint.scoped()
    state = one_answer.run(backend=backend, stream=True)
    pieces = list(state.text_iter("a"))
    assert len(pieces) > 1 and "".join(pieces) == whole["a"]
    cost = backend.recorder.snapshot()
    assert cost.requests == 1 and cost.decode_tokens == 12
    assert cost.prompt_tokens == len(backend.tokenize(PROMPT, add_special_tokens=True))
    state.sync()  # the last chunk's meta has every output id, as a whole request's does
    assert state.get_meta_info("a")[OUTPUT_IDS_KEY] == whole.get_meta_info("a")[OUTPUT_IDS_KEY]

    async def collect():
        state = one_answer.run(backend=backend, stream=True)
        return "".join([piece async for piece in state.text_async_iter("a")])

    assert asyncio.run(collect()) == whole["a"]
    assert backend.recorder.snapshot().requests == 2


@pytest.mark.server
def test_a_flush_waits_for_the_running_request_then_empties_the_cache(runtime):
    """SGLang refuses a flush while a request is in its batch (a notebook's flush right after a
    program once failed so): the backend's flush waits for the server to be idle, and says
    what to do when it waits too long."""
    import json
    import threading

    import requests

    body = {"text": PROMPT, "stream": True,
            "sampling_params": {"max_new_tokens": 160, "temperature": 0, "ignore_eos": True}}
    started, tokens = threading.Event(), []

    def stream():
        with requests.post(runtime.url + "/generate", json=body, stream=True, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith(b"data:") and line != b"data: [DONE]":
                    tokens.append(json.loads(line[5:])["meta_info"]["completion_tokens"])
                    started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        assert started.wait(120)
        with pytest.raises(RuntimeError, match="a request is still running there; wait for it"):
            runtime.endpoint.flush_cache(wait=0.5)
        runtime.endpoint.flush_cache()  # waits out the 160 tokens
    finally:
        thread.join()
    assert tokens[-1] == 160
    out = runtime.generate(PROMPT, max_new_tokens=1)
    assert out["meta_info"]["cached_tokens"] == 0  # the flush emptied the tree


@pytest.mark.server
def test_a_flush_refused_for_another_reason_than_busy_raises_at_once(runtime):
    """Only SGLang's busy 400 is waited out: any other refusal (a wrong API key's 401, a wrong
    path's 404) raises with the server's own answer, not the busy message ``wait`` seconds on."""
    backend = runtime.endpoint.scoped()
    backend.base_url = runtime.url + "/no/such/prefix"  # the real server answers 404 here
    with pytest.raises(RuntimeError) as error:
        backend.flush_cache(wait=300)
    assert "Not Found" in str(error.value)
    assert "kept refusing" not in str(error.value)
