"""``await sgl_reason.arun(program, ...)``: programs from asyncio code (notebooks, services).

SGLang's frontend is synchronous: a program's ``+=`` operations run on its state's executor
thread, a fork's branches on theirs, and ``gen`` blocks that thread on HTTP. ``arun`` moves the
one blocking call, the program's entry point, to a worker thread (``asyncio.to_thread``), so the
event loop stays free; the program itself runs exactly as ``program.run()`` would, with the
threads SGLang gives it and no thread per branch added. Streaming from asyncio needs no thread
at all: ``state = program.run(..., stream=True)`` then ``async for x in
state.text_async_iter(var)``.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from sglang.lang.ir import SglFunction


async def arun(program: Any, *args, backend=None, **kwargs) -> Any:
    """Run ``program`` without blocking the event loop and return what it returns.

    ``program`` is a built-in entry point (``self_consistency``, ``think_then_answer``,
    ``best_of_n`` or any function of yours taking ``backend=``), which returns its
    ``ProgramResult``, or an ``@sgl.function``, which returns its finished ``ProgramState``
    (synced: every ``gen`` done, so the state's variables and meta info are readable).
    """
    if isinstance(program, SglFunction):
        def call():
            state = program.run(*args, backend=backend, **kwargs)
            state.sync()
            return state
    elif callable(program):
        call = functools.partial(program, *args, backend=backend, **kwargs)
    else:
        raise TypeError("arun takes an @sgl.function or a program entry point such as "
                        f"sgl_reason.self_consistency, got {type(program).__name__}")
    return await asyncio.to_thread(call)
