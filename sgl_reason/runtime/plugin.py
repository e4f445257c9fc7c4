"""SGLang plugin entry point (group ``sglang.srt.plugins``), run in every SGLang process."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    """Called by SGLang's ``load_plugins()`` in the launcher, scheduler and detokenizer.

    The CPU compatibility layer must already be active before SGLang imports its modules, which
    happens before plugins load; the ``.pth`` hook does that. This re-arms it for processes where
    the hook was disabled or the package is on ``sys.path`` without the ``.pth`` file.
    """
    from sgl_reason.runtime import cpu_attention, cpu_compat

    cpu_compat.activate()
    try:
        cpu_attention.install()
    except Exception:  # SGLang only logs plugin errors; make this one impossible to miss
        logger.exception("sgl-reason: CPU attention could not be installed")
        raise
