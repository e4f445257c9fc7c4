"""The real SGLang server on CPU: generation, prefix reuse, forks, clean shutdown, errors."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests

from sgl_reason import EmbeddedRuntime, RequestError, ServerStartError
from sgl_reason.runtime.server import group_pids

pytestmark = pytest.mark.server


def test_generate_returns_tokens(runtime):
    out = runtime.generate("The capital of France is", max_new_tokens=8, temperature=0)
    assert out["meta_info"]["completion_tokens"] == 8
    assert len(out["output_ids"]) == 8 and out["text"]


def test_shared_prefix_is_reused(fresh_cache):
    """A second request sharing a 1,000-token prefix reuses >= 90% of it."""
    prefix = "".join(f"Fact {i}: the number {i} is {'even' if i % 2 == 0 else 'odd'}. " for i in range(200))
    first = fresh_cache.generate(prefix + "Question A?", max_new_tokens=1, temperature=0)
    prefix_tokens = first["meta_info"]["prompt_tokens"]
    assert prefix_tokens >= 1000
    second = fresh_cache.generate(prefix + "Question B?", max_new_tokens=1, temperature=0)
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] >= 0.9 * prefix_tokens


def test_frontend_fork_shares_the_prefix(fresh_cache):
    import sglang as sgl

    @sgl.function
    def branches(s, prompt):
        s += prompt
        s.sync()  # commit the prefix before forking (SGLang's fork races otherwise)
        forks = s.fork(4)
        for i, f in enumerate(forks):
            f += f" Branch {i}:"
            f += sgl.gen("out", max_tokens=4, temperature=0.7)
        s["outs"] = [f["out"] for f in forks]
        s["cached"] = [f.get_meta_info("out")["cached_tokens"] for f in forks]
        s["prompt"] = [f.get_meta_info("out")["prompt_tokens"] for f in forks]

    prompt = "A long shared context. " * 60
    state = branches.run(prompt=prompt, backend=fresh_cache.endpoint)
    assert len(state["outs"]) == 4
    for cached, total in zip(state["cached"], state["prompt"]):
        assert cached >= total - 8, (state["cached"], state["prompt"])


def test_runtime_cleanup_and_pool_limit():
    """A second embedded server: a too-long request names the fix; exit leaves no process and
    none of the shared-memory files SGLang's own shutdown leaves in /dev/shm."""
    shm = Path("/dev/shm")
    before = set(shm.iterdir())
    with EmbeddedRuntime(extra_args=["--max-total-tokens", "512"]) as rt:
        pids = rt.server.group_pids()
        assert rt.pid in pids and len(pids) >= 3  # launcher, scheduler, detokenizer
        made = set(shm.iterdir()) - before
        assert any(p.name.startswith("sglang_loads_") for p in made), made  # still SGLang's?
        with pytest.raises(RequestError, match=r"KV pool holds 512 tokens.*--max-total-tokens"):
            rt.generate("hello " * 1000, max_new_tokens=4)
    assert rt.server.group_pids() == []
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)
    assert set(shm.iterdir()) - before == set()


@pytest.mark.extended
def test_a_picked_port_taken_during_start_up_is_replaced(caplog):
    """Another process binds the port the runtime picked before the server does: the start
    sees uvicorn's bind error (the server would hang, not exit), retries on another port, and
    leaves nothing of the failed try behind."""
    from sgl_reason.runtime.server import ServerProcess

    shm = Path("/dev/shm")
    before = set(shm.iterdir())
    proc = ServerProcess(extra_args=["--max-total-tokens", "512"])
    taken = proc.port
    with socket.socket() as other:
        other.bind((proc.host, taken))
        other.listen()
        try:
            proc.start()
            assert proc.port != taken
            assert requests.get(proc.url + "/health", timeout=10).status_code == 200
            assert f"port {taken} was taken" in caplog.text
        finally:
            proc.stop()
    assert proc.group_pids() == []
    assert set(shm.iterdir()) - before == set()  # the failed try's files too


def test_a_bad_flag_fails_with_the_one_line_that_names_it():
    with pytest.raises(ServerStartError) as info:
        EmbeddedRuntime(extra_args=["--no-such-flag"]).start()
    message = str(info.value)
    assert "error:" in info.value.reason and "--no-such-flag" in info.value.reason
    assert message.splitlines()[0].endswith(info.value.reason)  # the reason leads
    assert "usage:" not in message and len(message.splitlines()) <= 3  # no usage text


def test_serve_prints_the_reason_not_sglangs_usage():
    out = subprocess.run([sys.executable, "-m", "sgl_reason", "serve", "--no-such-flag"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    text = out.stdout + out.stderr
    assert "--no-such-flag" in text and "rerun with -v" in text
    assert len(text.splitlines()) <= 6, text


def test_failure_reason_finds_the_parsers_line_else_the_exception():
    from sgl_reason.runtime.server import failure_reason

    usage = ["usage: sglang serve [-h] [--model-path MODEL_PATH]", "  --port PORT",
             "sglang serve: error: unrecognized arguments: --nope"]
    assert failure_reason(usage) == "sglang serve: error: unrecognized arguments: --nope"
    trace = ["Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
             "    raise ValueError('bad')", "ValueError: --page-size must be 1 for this"]
    assert failure_reason(trace) == "ValueError: --page-size must be 1 for this"
    assert failure_reason(["loading weights", "done"]) is None


def test_serve_cli_starts_and_stops_on_sigterm():
    """`sgl-reason serve` prints the URL when ready and stops its whole group on SIGTERM."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "sgl_reason", "serve"], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        url = None
        deadline = time.monotonic() + 300
        for line in proc.stdout:
            if "server ready at" in line:
                url = line.split("ready at ")[1].split()[0]
                break
            assert time.monotonic() < deadline
        assert url is not None, "serve exited before it was ready"
        r = requests.post(url + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
        assert r.json()["meta_info"]["completion_tokens"] == 2
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert alive == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.stdout.close()


SCRIPT = """
import time
from sgl_reason import EmbeddedRuntime
rt = EmbeddedRuntime().start()  # as a notebook does: no with block, no shutdown
print("server", rt.pid, flush=True)
time.sleep(600)
"""


def test_a_script_sent_sigterm_stops_its_embedded_server():
    """A plain script (no handler, no ``with``, no shutdown) killed with SIGTERM still stops its
    server: SIGTERM unwinds as Ctrl-C does, and the interpreter's exit stops what is left."""
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    server = None
    try:
        line = proc.stdout.readline()  # blocks until the server is ready (or the script died)
        assert line.startswith("server "), f"the script did not start a server: {line!r}"
        server = int(line.split()[1])
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and group_pids(server):
            time.sleep(0.5)
        assert not group_pids(server), "the embedded server outlived its script"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if server is not None and group_pids(server):
            os.killpg(server, signal.SIGKILL)
        proc.stdout.close()



def test_a_server_bound_beyond_loopback_refuses_client_code():
    """Bound to every interface, the server takes no logit processor (SGLang would unpickle the
    client's code), answers such a request with a 4xx that names the flag, and serves on."""
    from sgl_reason.programs.budget import BudgetForcingProcessor
    from sgl_reason.runtime.server import ServerProcess

    proc = ServerProcess(host="0.0.0.0", extra_args=["--max-total-tokens", "1024"])
    try:
        proc.start()
        local = f"http://127.0.0.1:{proc.port}"  # traffic stays on loopback
        info = requests.get(local + "/get_server_info", timeout=30).json()
        assert info["enable_custom_logit_processor"] is False
        r = requests.post(local + "/generate", timeout=60, json={
            "text": "Hi", "custom_logit_processor": BudgetForcingProcessor.to_str(),
            "sampling_params": {"max_new_tokens": 2}})
        assert 400 <= r.status_code < 500 and "--enable-custom-logit-processor" in r.text
        r = requests.post(local + "/generate", timeout=60,
                          json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
        assert r.json()["meta_info"]["completion_tokens"] == 2
    finally:
        proc.stop()
    assert proc.group_pids() == []
