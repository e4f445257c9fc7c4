"""A server killed (SIGKILL) in the middle of a program or an eval: a clear error in bounded
time, no hang; eval's finished records intact and a rerun resumes; no process left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import sgl_reason
from sgl_reason import EmbeddedRuntime, ServerUnreachable

pytestmark = [pytest.mark.server, pytest.mark.extended]

# A long budget keeps requests running until the kill (five of them reserve 10,000 of the
# 16,384-token pool, leaving room for the eval's requests). One run's think-then-answer
# finished before the kill (SmolLM2 at 0.7 can close its thinking itself): a minimum reopens it.
LONG = sgl_reason.ThinkingBudget(max_thinking_tokens=2000, min_thinking_tokens=1900,
                                 max_answer_tokens=16)


def _eval(url: str, out, limit: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sgl_reason", "eval", "--program", "think_then_answer",
         "--data", "data/reasoner_heldout.jsonl", "--limit", str(limit), "--concurrency", "1",
         "--max-thinking-tokens", "48", "--max-answer-tokens", "16", "--url", url,
         "--out", str(out)],
        capture_output=True, text=True, timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_a_server_killed_mid_work_fails_each_client_clearly_and_soon(tmp_path, runtime):
    """One server, three clients: an eval writing records, a self-consistency call and a
    think-then-answer call (SmolLM2 never closes its thinking, so both are mid-request). After
    the SIGKILL each fails with the same clear error within seconds; the eval's finished
    records are whole and a rerun on another server resumes after them."""
    out = tmp_path / "run.jsonl"
    calls = {
        "self_consistency": lambda rt: sgl_reason.self_consistency(
            "What is 2 + 2?", n=4, think=LONG, backend=rt.endpoint),
        "think_then_answer": lambda rt: sgl_reason.think_then_answer(
            "What is 2 + 2?", budget=LONG, backend=rt.endpoint),
    }
    raised: dict[str, tuple[BaseException | None, float]] = {}

    def program(name, rt):
        try:
            calls[name](rt)
            raised[name] = (None, time.monotonic())
        except BaseException as error:  # noqa: BLE001  (inspected below)
            raised[name] = (error, time.monotonic())

    with EmbeddedRuntime() as rt:
        results: list[subprocess.CompletedProcess] = []
        clients = [threading.Thread(target=lambda: results.append(_eval(rt.url, out, 40)))]
        clients += [threading.Thread(target=program, args=(name, rt)) for name in calls]
        for t in clients:
            t.start()
        deadline = time.monotonic() + 180
        while (not out.exists() or len(out.read_text().splitlines()) < 3) and \
                time.monotonic() < deadline:
            time.sleep(0.5)
        os.kill(rt.pid, signal.SIGKILL)
        killed = time.monotonic()
        for t in clients:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in clients), "a client hung on a dead server"
    assert rt.server.group_pids() == []  # the rest of its process group is gone too
    assert set(raised) == set(calls)
    for name, (error, when) in raised.items():
        assert isinstance(error, ServerUnreachable), (name, error)
        assert "stopped answering mid-request" in str(error)
        assert when - killed < 30, (name, when - killed)
    first = results[0]
    assert first.returncode == 2 and "stopped answering mid-request" in first.stderr
    kept = [json.loads(line) for line in out.read_text().splitlines()]  # every line whole
    assert 3 <= len(kept) < 40
    again = _eval(runtime.url, out, len(kept) + 2)  # resumed on another server of that model
    assert again.returncode == 0, again.stderr[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == len(kept) + 2  # the finished ones kept, only the rest run
    assert [r["id"] for r in records[:len(kept)]] == [r["id"] for r in kept]
