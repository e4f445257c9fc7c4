"""``sgl_reason.track()``: the cost of whatever runs inside a ``with`` block.

    with sgl_reason.track() as cost:
        state = my_program.run(question="...")   # any @sgl.function, built-in programs too
        state.sync()                             # run() returns before its last gen ends
    print(cost())                                # a Cost: requests, prefill computed, ...

What is counted: every ``/generate`` request that a :class:`~sgl_reason.backend.ReasonBackend`
of this process (or a scoped copy of it) sends to the tracked server while the block runs, with
the server's own token counts; streamed requests when their stream ends. Requests from other
threads of the process to the same server count too: run one tracked block at a time per
server when the figures must be one program's. ``thinking_tokens``/``answer_tokens`` stay 0:
only a program knows where its thinking ends (the built-in programs' results carry them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from sgl_reason.cost import Cost, CostRecorder

_LOCK = threading.Lock()
_ACTIVE: list[Tracker] = []


class Tracker:
    """The ledger of one ``track()`` block; call it (or read :attr:`cost`) for the cost so far,
    ``seconds`` being the block's wall time (frozen when the block ends)."""

    def __init__(self, url: str | None):
        self.url = url  # the tracked server; None: every server
        self._recorder = CostRecorder()
        self._start = time.perf_counter()
        self._end: float | None = None

    def __call__(self) -> Cost:
        end = self._end if self._end is not None else time.perf_counter()
        return self._recorder.snapshot().model_copy(update={"seconds": end - self._start})

    @property
    def cost(self) -> Cost:
        return self()


def record(url: str, meta_info: dict) -> None:
    """Called by ``ReasonBackend`` for every finished request: add it to each open block that
    tracks ``url``."""
    with _LOCK:
        trackers = [t for t in _ACTIVE if t.url is None or t.url == url]
    for tracker in trackers:
        tracker._recorder.record(meta_info)


@contextmanager
def track(backend=None) -> Iterator[Tracker]:
    """Record the cost of the requests sent to ``backend``'s server inside the block.

    ``backend``: a ``ReasonBackend``; None means the frontend's default backend
    (``EmbeddedRuntime.set_default_backend()``), or every server when there is none. Raises
    TypeError for any other backend, whose requests would go uncounted."""
    if backend is None:
        from sglang.lang.global_config import global_config

        backend = global_config.default_backend
    url = None
    if backend is not None:
        from sgl_reason.backend import ReasonBackend

        if not isinstance(backend, ReasonBackend):
            raise TypeError(
                f"track() counts the requests of a ReasonBackend, and the backend is a "
                f"{type(backend).__name__}: use sgl_reason.ReasonBackend(url) in its place (a "
                "drop-in for RuntimeEndpoint), or EmbeddedRuntime().set_default_backend()")
        url = backend.base_url
    tracker = Tracker(url)
    with _LOCK:
        _ACTIVE.append(tracker)
    try:
        yield tracker
    finally:
        tracker._end = time.perf_counter()
        with _LOCK:
            _ACTIVE.remove(tracker)
