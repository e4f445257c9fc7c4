"""sgl-reason: reasoning programs and a thinking-aware SGLang runtime.

Importing this package is cheap (it runs in every process through a ``.pth`` hook); the public
names below load their modules on first use.
"""

from __future__ import annotations

import importlib
import warnings

# SGLang reads every SGL_* variable as a deprecated alias of SGLANG_*; ours is not one.
warnings.filterwarnings("ignore", message="Environment variable SGL_REASON_HOME is deprecated")

__version__ = "0.1.0"

_LAZY = {
    "EmbeddedRuntime": "sgl_reason.runtime.embedded",
    "RequestError": "sgl_reason.runtime.embedded",
    "ServerStartError": "sgl_reason.runtime.server",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sgl_reason' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
