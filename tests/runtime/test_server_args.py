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
    assert server.flag_value(args, "--mem-fraction-static") == "0.05"


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


@pytest.fixture
def runtime_model_path(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return tmp_path
