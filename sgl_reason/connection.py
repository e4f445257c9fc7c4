"""``connect()``: a :class:`ReasonBackend` on a running server, or on an embedded one started
for the block and stopped after it. The one place that choice is made (CLI commands,
benchmarks and recipes use it)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

from sgl_reason.backend import ReasonBackend, ServerUnreachable

logger = logging.getLogger(__name__)

__all__ = ["ServerUnreachable", "connect"]


@contextlib.contextmanager
def connect(url: str | None = None, *, model: str | Path | None = None,
            extra_args: Sequence[str] = ()) -> Iterator[ReasonBackend]:
    """Yield a backend on ``url``, or (``url`` None) on an embedded server of ``model`` (a name
    or a folder; default SmolLM2) with ``extra_args``, stopped when the block ends.

    ``model``/``extra_args`` choose how a server starts, so they are refused with a ``url``
    (that server serves its own model)."""
    if url:
        if model is not None or extra_args:
            raise ValueError("model and extra_args configure an embedded server; the server at "
                             f"{url} serves its own model: pass one or the other")
        try:
            backend = ReasonBackend(url.rstrip("/"))
        except Exception as error:  # noqa: BLE001  (urllib raises several types here)
            raise ServerUnreachable(
                f"no SGLang server answers at {url} ({error}). Start one with `sgl-reason "
                "serve`, or pass no URL to start an embedded server.") from None
        yield backend
        return
    from sgl_reason.runtime.embedded import EmbeddedRuntime

    with EmbeddedRuntime(model=model, extra_args=extra_args) as rt:
        logger.info("embedded SGLang server at %s", rt.url)
        yield rt.endpoint
