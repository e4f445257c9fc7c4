"""The CPU compatibility layer, checked in fresh interpreters (it acts at interpreter start)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from sgl_reason.runtime import cpu_compat


def run_python(code: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, env=env, timeout=120,
    )


def test_stand_in_kernel_raises_naming_the_op():
    kernel = cpu_compat.UnavailableKernel("sgl_kernel.copy_all_layer_kv_cache_cpu")
    with pytest.raises(cpu_compat.KernelUnavailableError, match="copy_all_layer_kv_cache_cpu"):
        kernel(1, 2)
    with pytest.raises(cpu_compat.KernelUnavailableError, match=r"sgl_kernel\.ops\.fused"):
        kernel.__class__("sgl_kernel.ops").fused()


@pytest.mark.skipif(cpu_compat.has_real_kernels(), reason="a real sgl_kernel is installed")
def test_pth_hook_arms_cpu_engine_on_sglang_import():
    """Every process of the environment gets it, before any SGLang module imports sgl_kernel."""
    result = run_python(
        """
        import os, sys
        assert "SGLANG_USE_CPU_ENGINE" not in os.environ
        import sglang  # the watcher fires here
        assert os.environ["SGLANG_USE_CPU_ENGINE"] == "1"
        from sgl_kernel import assign_req_to_token_pool_cpu   # top-level import in SGLang
        import sgl_kernel.kvcacheio
        try:
            assign_req_to_token_pool_cpu()
        except RuntimeError as e:
            print("raised:", e)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "raised: sgl_kernel.assign_req_to_token_pool_cpu was called" in result.stdout


def test_cpu_compat_can_be_disabled():
    result = run_python(
        """
        import sys
        print(sorted(type(f).__name__ for f in sys.meta_path if "Sglang" in type(f).__name__))
        """,
        {"SGL_REASON_NO_CPU_COMPAT": "1"},
    )
    assert result.stdout.strip() == "[]", result.stderr


@pytest.mark.skipif(cpu_compat.has_real_kernels(), reason="a real sgl_kernel is installed")
def test_torchvision_imports_beside_cpu_torch():
    """SGLang imports torchvision.transforms at module top level; it must import here."""
    result = run_python(
        """
        import sglang, torch
        import torchvision.transforms as T
        from sglang.srt.configs import model_config   # pulls internvl_utils -> torchvision
        print("ok", hasattr(torch.ops.torchvision, "nms"))
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok True"
