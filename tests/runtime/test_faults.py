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

pytestmark = pytest.mark.server

# SmolLM2 never closes its thinking: a long budget keeps requests running until the kill
LONG = sgl_reason.ThinkingBudget(max_thinking_tokens=4000, max_answer_tokens=16)


def _kill_soon(rt: EmbeddedRuntime, after: float) -> threading.Timer:
    timer = threading.Timer(after, lambda: os.kill(rt.pid, signal.SIGKILL))
    timer.start()
    return timer


@pytest.mark.parametrize("program", ["self_consistency", "think_then_answer"])
def test_a_program_whose_server_dies_raises_clearly_and_soon(program):
    with EmbeddedRuntime() as rt:
        call = {
            "self_consistency": lambda: sgl_reason.self_consistency(
                "What is 2 + 2?", n=4, think=LONG, backend=rt.endpoint),
            "think_then_answer": lambda: sgl_reason.think_then_answer(
                "What is 2 + 2?", budget=LONG, backend=rt.endpoint),
        }[program]
        _kill_soon(rt, 8.0)
        started = time.monotonic()
        with pytest.raises(ServerUnreachable, match="stopped answering mid-request"):
            call()
        assert time.monotonic() - started < 60
    assert rt.server.group_pids() == []  # the rest of its process group is gone too


def _eval(url: str, out, limit: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sgl_reason", "eval", "--program", "think_then_answer",
         "--data", "data/reasoner_heldout.jsonl", "--limit", str(limit), "--concurrency", "1",
         "--max-thinking-tokens", "48", "--max-answer-tokens", "16", "--url", url,
         "--out", str(out)],
        capture_output=True, text=True, timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_eval_stops_on_a_dead_server_keeps_its_records_and_resumes(tmp_path, runtime):
    out = tmp_path / "run.jsonl"
    with EmbeddedRuntime() as rt:
        proc = threading.Thread(target=lambda: results.append(_eval(rt.url, out, 40)))
        results: list[subprocess.CompletedProcess] = []
        proc.start()
        deadline = time.monotonic() + 300
        while (not out.exists() or len(out.read_text().splitlines()) < 3) and \
                time.monotonic() < deadline:
            time.sleep(0.5)
        os.kill(rt.pid, signal.SIGKILL)
        proc.join(timeout=120)
        assert not proc.is_alive(), "eval hung on a dead server"
    first = results[0]
    assert first.returncode == 2 and "stopped answering mid-request" in first.stderr
    kept = [json.loads(line) for line in out.read_text().splitlines()]  # every line whole
    assert 3 <= len(kept) < 40
    again = _eval(runtime.url, out, len(kept) + 2)  # resumed on another server of that model
    assert again.returncode == 0, again.stderr[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == len(kept) + 2  # the finished ones kept, only the rest run
    assert [r["id"] for r in records[:len(kept)]] == [r["id"] for r in kept]
