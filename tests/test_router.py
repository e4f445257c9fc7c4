"""Scale-out: two embedded CPU servers behind sglang-router; forks still reuse their prefix."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from sgl_reason import EmbeddedRuntime, ReasonBackend, self_consistency
from sgl_reason.runtime.server import free_port

pytestmark = [pytest.mark.server, pytest.mark.slow]


@pytest.fixture
def router(runtime):
    with EmbeddedRuntime() as second:
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
             "--port", str(port), "--policy", "cache_aware",
             "--worker-urls", runtime.url, second.url],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # up, and both workers registered
                try:
                    if requests.get(url + "/get_model_info", timeout=5).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                time.sleep(0.5)
            else:
                pytest.fail("sglang-router did not become ready with its workers")
            yield url
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)


def test_forked_program_reuses_its_prefix_through_the_router(router):
    backend = ReasonBackend(router)
    question = "Context: " + " ".join(f"item {i} costs {i % 7} dollars." for i in range(120))
    result = self_consistency(question + "\nWhat does item 5 cost?", n=4, max_tokens=8,
                              backend=backend)
    cost = result.cost
    prompt = cost.prompt_tokens // cost.requests
    assert prompt > 500
    # cache-aware routing sends every branch to the worker that holds the committed prefix
    assert cost.computed_prefill_tokens <= prompt + 4 * 2, cost
