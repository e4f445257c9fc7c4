"""sgl-reason: reasoning programs and a thinking-aware SGLang runtime.

Importing this package is cheap (it runs in every process through a ``.pth`` hook); the public
names below load their modules on first use.
"""

from __future__ import annotations

import importlib
import warnings

# SGLang reads every SGL_* variable as a deprecated alias of SGLANG_* and warns that it should
# be renamed; ours (SGL_REASON_*: flags exported to the scheduler, paths) are not aliases.
warnings.filterwarnings("ignore", message=r"Environment variable SGL_REASON_\w+ is deprecated")

__version__ = "0.1.0"

_LAZY = {
    # runtime
    "EmbeddedRuntime": "sgl_reason.runtime.embedded",
    "connect": "sgl_reason.connection",
    "ServerUnreachable": "sgl_reason.connection",
    "RequestError": "sgl_reason.runtime.embedded",
    "ServerStartError": "sgl_reason.runtime.server",
    # programs
    "ReasonBackend": "sgl_reason.backend",
    "ProgramCancelled": "sgl_reason.backend",
    "self_consistency": "sgl_reason.programs",
    "think_then_answer": "sgl_reason.programs",
    "best_of_n": "sgl_reason.programs",
    "agent_steps": "sgl_reason.programs",
    "p_yes_verifier": "sgl_reason.programs",
    "arithmetic_verifier": "sgl_reason.programs",
    "ThinkingBudget": "sgl_reason.programs",
    "KVPolicy": "sgl_reason.programs",
    "Sampling": "sgl_reason.profiles",
    "ProgramResult": "sgl_reason.programs",
    "Sample": "sgl_reason.programs",
    "Cost": "sgl_reason.cost",
    "ModelProfile": "sgl_reason.profiles",
    "profile_for": "sgl_reason.profiles",
    "VoteConfig": "sgl_reason.vote",
    "vote": "sgl_reason.vote",
    "extract_answer": "sgl_reason.vote",
    # your own programs
    "track": "sgl_reason.tracking",
    "arun": "sgl_reason.aio",
    "normalize": "sgl_reason.normalization",
    "think": "sgl_reason.programs.think_then_answer",
    "forks": "sgl_reason.programs.common",
    "ThinkPlan": "sgl_reason.programs.think_then_answer",
    "EarlyStop": "sgl_reason.early_stop",
    "load_problems": "sgl_reason.data",
}
# Public names that are modules: sgl_reason.evaluate.run(program, problems, out), ...
_MODULES = {"evaluate": "sgl_reason.evaluate"}

__all__ = ["__version__", *_LAZY, *_MODULES]


def __getattr__(name: str):
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name])
        globals()[name] = value
        return value
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sgl_reason' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
