"""SGLang plugin entry points (group ``sglang.srt.plugins``), run in every SGLang process.

Two plugins, so that either can be left out with SGLang's allow-list (``SGLANG_PLUGINS``):

| entry point      | installs                                                              |
|------------------|-----------------------------------------------------------------------|
| ``sgl_reason_cpu`` | CPU attention for torch_native (``cpu_attention``); ``--kv-scale`` and the per-token FP8 KV pool (``fp8_kv``), with its Triton-backend kernel where CUDA exists (``triton_fp8``) |
| ``sgl_reason``     | thinking-aware KV: the ``sgl-reason`` radix cache backend, ``--thinking-kv-*`` and ``--think-end`` (``thinking_kv``) |

``SGLANG_PLUGINS=sgl_reason_cpu`` is stock SGLang's scheduling and caching on this project's CPU
attention: the baseline the thinking-KV benchmark compares against.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

# The patches replace SGLang internals by name; they are written against exactly this release.
SUPPORTED_SGLANG = "0.5.23"
VERSION_OVERRIDE_ENV = "SGL_REASON_ANY_SGLANG"


def check_sglang_version(version: str | None = None) -> None:
    """Refuse to patch an SGLang release the runtime was not written against, where a patch
    could silently miss, unless :data:`VERSION_OVERRIDE_ENV` is set to 1."""
    if version is None:
        import sglang

        version = getattr(sglang, "__version__", "unknown")
    if version == SUPPORTED_SGLANG or os.environ.get(VERSION_OVERRIDE_ENV) == "1":
        return
    raise RuntimeError(
        f"sgl-reason's runtime patches are written for SGLang {SUPPORTED_SGLANG}, and SGLang "
        f"{version} is installed. Install sglang=={SUPPORTED_SGLANG} (`pip install "
        f"\"sgl-reason[gpu]\"` or `make setup`), or set {VERSION_OVERRIDE_ENV}=1 to try anyway."
    )


def register_cpu() -> None:
    """CPU attention and the FP8 per-token KV pool.

    The CPU compatibility layer must already be active before SGLang imports its modules, which
    happens before plugins load; the ``.pth`` hook does that. This re-arms it for processes where
    the hook was disabled or the package is on ``sys.path`` without the ``.pth`` file.
    """
    import torch

    from sgl_reason.runtime import cpu_attention, cpu_compat, fp8_kv

    cpu_compat.activate()
    check_sglang_version()
    _install(cpu_attention.install, fp8_kv.install)
    if torch.cuda.is_available():  # the per-token pool's GPU path (SGLang's Triton backend)
        from sgl_reason.runtime import triton_fp8

        _install(triton_fp8.install)


def register() -> None:
    """Thinking-aware KV release (radix cache backend, flags, scheduler hooks)."""
    from sgl_reason.runtime import thinking_kv

    check_sglang_version()
    _install(thinking_kv.install)


def _install(*installers) -> None:
    try:
        for install in installers:
            install()
    except Exception:  # SGLang only logs plugin errors; make this one impossible to miss
        logger.exception("sgl-reason: the runtime patches could not be installed")
        raise
