"""Make the unmodified SGLang 0.5.23 server start on a machine without CUDA.

Installed as ``sgl_reason_cpu.pth`` in site-packages, so :func:`install` runs at the start of
every Python process of the environment: the launcher, the scheduler and the detokenizer that
SGLang spawns, and a user's own ``python -m sglang.launch_server --device cpu``. It must stay
cheap: it imports nothing heavy and only arms two import hooks.

What it does, and only when ``sglang`` is imported in an environment without a real
``sgl_kernel`` (the CUDA kernel package, which has no CPU build):

1. Sets ``SGLANG_USE_CPU_ENGINE=1`` unless the user set it, so ``sglang`` takes its CPU code path
   (without it, model init fails on ``import vllm`` in the rotary embedding).
2. Provides a stand-in ``sgl_kernel`` package. With the CPU engine on, a few SGLang modules import
   CPU ops from ``sgl_kernel`` at module top level (``copy_all_layer_kv_cache_cpu``,
   ``assign_req_to_token_pool_cpu``, speculative-decoding ops); none of them is called on a CPU
   without AMX, but the imports must succeed. Every attribute of the stand-in is an
   :class:`UnavailableKernel` that raises a :class:`KernelUnavailableError` naming the op if it is
   ever called, so nothing silently does the wrong thing.

3. Lets torchvision import (armed at interpreter start, since transformers imports torchvision
   whenever it is installed, SGLang or not). SGLang's config package imports ``torchvision.transforms`` at module
   top level (``srt/multimodal/internvl_utils.py``), so the server needs it even for a text model,
   but the registry's torchvision is a CUDA build whose ``_C.so`` does not load beside CPU torch.
   torchvision then still registers fake kernels for ``torchvision::nms``/``qnms``, which fails
   with "operator torchvision::nms does not exist". When (and only when) its ``_C`` library does
   not load, the op schemas are defined before torchvision imports; calling them still fails
   loudly (no kernel), which is right: the text-only runtime never calls them.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import types

logger = logging.getLogger(__name__)

KERNEL_PACKAGE = "sgl_kernel"
CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"
DISABLE_ENV = "SGL_REASON_NO_CPU_COMPAT"


class KernelUnavailableError(RuntimeError):
    """A CUDA/AMX kernel from ``sgl_kernel`` was called on a machine that has no build of it."""


class UnavailableKernel:
    """Stands in for one ``sgl_kernel`` op; calling it raises :class:`KernelUnavailableError`."""

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __call__(self, *args, **kwargs):
        raise KernelUnavailableError(
            f"{self._qualname} was called, but this machine has no sgl_kernel build (CUDA only): "
            "sgl-reason put a stand-in in its place so that SGLang's CPU engine can import. "
            "Run this code path on a GPU machine with `pip install \"sgl-reason[gpu]\"`, or use "
            "a CPU configuration that does not need this op (--device cpu "
            "--attention-backend torch_native, no speculative decoding)."
        )

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return UnavailableKernel(f"{self._qualname}.{name}")

    def __repr__(self) -> str:
        return f"<unavailable kernel {self._qualname}>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return UnavailableKernel(f"{self.__name__}.{name}")


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []  # a package, so `import sgl_kernel.sub` also resolves here
        module.__sgl_reason_stand_in__ = True
        return module

    def exec_module(self, module):
        pass


class _StandInFinder(importlib.abc.MetaPathFinder):
    """Last on ``sys.meta_path``: answers for ``sgl_kernel*`` only when no real one was found."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != KERNEL_PACKAGE and not fullname.startswith(KERNEL_PACKAGE + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, _StandInLoader(), is_package=True)


class _SglangImportWatcher(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: on the first ``import sglang`` it arms the CPU engine, then
    steps aside (it never provides a module itself)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "sglang":
            _remove(self)
            activate()
        return None


class _TorchvisionImportWatcher(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` once the CPU engine is armed: before torchvision's first import,
    defines its op schemas if its compiled library cannot load here."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            _remove(self)
            define_torchvision_schemas_if_unloadable()
        return None


# Schemas as torchvision 0.2x declares them; needed only for the two ops that torchvision
# registers fake kernels for with `torch.library.register_fake` at import time.
_TORCHVISION_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_torchvision_library = None  # keeps the fragment alive for the process lifetime


def define_torchvision_schemas_if_unloadable() -> bool:
    """Returns True when torchvision's ``_C`` failed to load and the schemas were defined."""
    global _torchvision_library
    spec = importlib.machinery.PathFinder.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations or _torchvision_library is not None:
        return False
    import glob

    import torch

    folder = list(spec.submodule_search_locations)[0]
    for lib in glob.glob(os.path.join(folder, "_C*.so")):
        try:
            torch.ops.load_library(lib)
            return False  # a working build: torchvision registers its own ops
        except OSError as error:
            reason = error
            break
    else:
        reason = "no _C library"
    if hasattr(torch.ops.torchvision, "nms"):
        return False
    logger.debug("torchvision's _C does not load here (%s); defining its op schemas", reason)
    _torchvision_library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _TORCHVISION_SCHEMAS:
        _torchvision_library.define(schema)
    return True


def _remove(finder) -> None:
    try:
        sys.meta_path.remove(finder)
    except ValueError:
        pass


def has_real_kernels() -> bool:
    """True when a real ``sgl_kernel`` is installed (then nothing here is used)."""
    return importlib.machinery.PathFinder.find_spec(KERNEL_PACKAGE) is not None


def is_stand_in(module: types.ModuleType) -> bool:
    return getattr(module, "__sgl_reason_stand_in__", False)


def activate() -> bool:
    """Arm the CPU engine for this process if it has no real kernels. Returns whether it did."""
    if os.environ.get(DISABLE_ENV) == "1" or has_real_kernels():
        return False
    os.environ.setdefault(CPU_ENGINE_ENV, "1")
    if not any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        sys.meta_path.append(_StandInFinder())
    _watch_torchvision()
    logger.debug("sgl-reason: no sgl_kernel build here; CPU engine armed with a stand-in")
    return True


def install() -> None:
    """Entry of the ``.pth`` file: arm the watcher, cheaply, once per process."""
    if os.environ.get(DISABLE_ENV) == "1":
        return
    if "sglang" in sys.modules:
        activate()
    elif not any(isinstance(f, _SglangImportWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _SglangImportWatcher())
    # transformers imports torchvision whenever it is installed, with or without SGLang.
    _watch_torchvision()


def _watch_torchvision() -> None:
    if "torchvision" not in sys.modules and not any(
        isinstance(f, _TorchvisionImportWatcher) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _TorchvisionImportWatcher())
