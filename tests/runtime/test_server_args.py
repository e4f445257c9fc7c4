"""Launcher argument handling and start-up errors that need no server."""

from __future__ import annotations

import socket

import pytest

from sgl_reason.runtime import server
from sgl_reason.runtime.server import ServerProcess, ServerStartError, build_server_args


def test_cpu_defaults_apply_and_user_flags_win():
    args = build_server_args("/m", "127.0.0.1", 1234, ["--max-total-tokens=4096"], cpu=True)
    assert server.flag_value(args, "--device") == "cpu"
    assert server.flag_value(args, "--attention-backend") == "torch_native"
    assert server.flag_value(args, "--max-total-tokens") == "4096"
    assert args.count("--max-total-tokens") == 0  # only the user's --max-total-tokens=4096
    assert server.flag_value(args, "--mem-fraction-static") == "0.2"


def test_gpu_machine_gets_no_cpu_defaults():
    args = build_server_args("/m", "0.0.0.0", 1234, ["--tp", "2"], cpu=False)
    assert not server.has_flag(args, "--device")
    assert not server.has_flag(args, "--max-total-tokens")
    assert args[-2:] == ["--tp", "2"]  # unknown flags pass through unchanged


def test_too_small_pool_is_refused_with_the_fix():
    with pytest.raises(ServerStartError, match=r"--max-total-tokens 64 is too small.*>= 256"):
        build_server_args("/m", "127.0.0.1", 1, ["--max-total-tokens", "64"], cpu=True)


def test_unknown_model_path(tmp_path):
    with pytest.raises(ServerStartError, match="not a model folder.*sgl-reason model prepare"):
        ServerProcess(model=tmp_path / "nope")


def test_port_in_use(runtime_model_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ServerStartError, match=f"Port {port} on 127.0.0.1 is in use"):
            ServerProcess(model=runtime_model_path, port=port)


def test_a_picked_port_is_one_no_outgoing_connection_can_take():
    """Ports from bind(host, 0) are ephemeral: a client connection made while the server starts
    may take one as its local port (a CI run lost a server start that way)."""
    low = server._ephemeral_low()
    ports = {server.free_port() for _ in range(20)}
    assert all(1024 <= p < low - server._INTERNAL_SPAN for p in ports), (ports, low)
    assert len(ports) > 1  # picked at random: two runtimes starting together do not collide


@pytest.fixture
def runtime_model_path(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


LOGIT = "--enable-custom-logit-processor"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_client_code_is_a_default_only_on_loopback(host):
    assert server.has_flag(build_server_args("/m", host, 1, [], cpu=True), LOGIT)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "my-host.example"])
def test_a_server_others_can_reach_runs_no_client_code_unless_asked(host, caplog):
    args = build_server_args("/m", host, 1, [], cpu=True)
    assert not server.has_flag(args, LOGIT)
    assert server.has_flag(args, "--sleep-on-idle")  # the other defaults still apply
    assert f"{LOGIT} is off: the server binds {host}" in caplog.text
    assert server.has_flag(build_server_args("/m", host, 1, [LOGIT], cpu=True), LOGIT)


def test_the_runtime_patches_refuse_an_sglang_they_were_not_written_for(monkeypatch):
    from sgl_reason.runtime import plugin

    plugin.check_sglang_version(plugin.SUPPORTED_SGLANG)
    monkeypatch.delenv(plugin.VERSION_OVERRIDE_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"written for SGLang 0\.5\.23, and SGLang 0\.6\.0 is "
                                           r"installed\. Install sglang==0\.5\.23"):
        plugin.check_sglang_version("0.6.0")
    monkeypatch.setenv(plugin.VERSION_OVERRIDE_ENV, "1")
    plugin.check_sglang_version("0.6.0")
