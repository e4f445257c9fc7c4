"""SGLang plugin entry point (group ``sglang.srt.plugins``), run in every SGLang process."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    """Called by SGLang's ``load_plugins()`` in the launcher, scheduler and detokenizer.

    Installs: CPU attention for torch_native (``cpu_attention``), and the ``--kv-scale`` flag,
    its validation and the per-token FP8 KV pool (``fp8_kv``).

    The CPU compatibility layer must already be active before SGLang imports its modules, which
    happens before plugins load; the ``.pth`` hook does that. This re-arms it for processes where
    the hook was disabled or the package is on ``sys.path`` without the ``.pth`` file.
    """
    from sgl_reason.runtime import cpu_attention, cpu_compat, fp8_kv

    cpu_compat.activate()
    try:
        cpu_attention.install()
        fp8_kv.install()
    except Exception:  # SGLang only logs plugin errors; make this one impossible to miss
        logger.exception("sgl-reason: the runtime patches could not be installed")
        raise
