"""What the programs share: result models, backend resolution, prompt opening, sampling."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import BaseModel, ConfigDict

from sgl_reason.backend import ReasonBackend, sync
from sgl_reason.cost import Cost
from sgl_reason.profiles import ModelProfile, Sampling, profile_for
from sgl_reason.vote import VoteResult


class Sample(BaseModel):
    """One decoded branch."""

    model_config = ConfigDict(extra="forbid")

    text: str  # everything the branch generated (thinking, marker and answer)
    thinking: str = ""  # the thinking part ("" without a thinking phase)
    answer_text: str  # the part answers are extracted from
    answer: str | None  # the extracted answer (None when none was found)
    thinking_tokens: int = 0
    answer_tokens: int = 0
    forced: bool = False  # thinking hit its budget and was closed by budget forcing
    finish_reason: str | None = None
    score: float | None = None  # verifier score (best_of_n) or confidence weight
    # early stop: {"signal", "at_token", "reason", "drop", "answer_from_probe"} when a signal
    # ended this trace
    stopped: dict | None = None


class ProgramResult(BaseModel):
    """Common shape of every program's result."""

    model_config = ConfigDict(extra="forbid")

    answer: str | None
    samples: list[Sample]
    vote: VoteResult | None = None
    cost: Cost
    info: dict[str, Any] = {}


def resolve_backend(backend: ReasonBackend | None) -> ReasonBackend:
    """The backend to run on, as a scoped copy with a fresh cost ledger."""
    if backend is None:
        from sglang.lang.global_config import global_config

        backend = global_config.default_backend
    if not isinstance(backend, ReasonBackend):
        raise TypeError(
            "sgl-reason programs need a ReasonBackend to account for costs, got "
            f"{type(backend).__name__ if backend is not None else 'no default backend'}. Pass "
            "backend=ReasonBackend(url), use EmbeddedRuntime().endpoint, or call "
            "EmbeddedRuntime.set_default_backend()."
        )
    return backend.scoped()


def resolve_profile(backend: ReasonBackend, profile: ModelProfile | None) -> ModelProfile:
    return profile or profile_for(backend.get_model_name())


def sampling_kwargs(profile: ModelProfile, sampling: Sampling | None) -> dict[str, Any]:
    s = sampling or profile.sampling
    kwargs = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k}
    if s.min_p:
        kwargs["min_p"] = s.min_p
    if s.ignore_eos:
        kwargs["ignore_eos"] = True
    return kwargs


Messages = list[dict]  # OpenAI-style chat turns: {"role": "system"|"user"|"assistant", "content"}
_ROLES = ("system", "user", "assistant")


def check_messages(messages: Messages) -> Messages:
    """Chat turns as a program takes them; ValueError naming the fix if they are not."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in _ROLES
                and isinstance(m.get("content"), str)):
            raise ValueError(f"messages[{i}] must be {{'role': one of {', '.join(_ROLES)}, "
                             f"'content': str}}, got {m!r}")
    if messages[-1]["role"] != "user":
        raise ValueError("the last message must be the user's: the program answers it")
    return messages


def prompt_texts(question: str | Messages, system: str | None, normalize_prompt: bool
                 ) -> tuple[str | Messages, str | None]:
    """The question (or chat turns) and system text a program sends: normalized
    (:mod:`sgl_reason.normalization`) unless the caller opted out, so drifted copies of one
    prompt share its cached prefix."""
    if not isinstance(question, str):
        check_messages(question)
    if not normalize_prompt:
        return question, system
    from sgl_reason.normalization import normalize

    if isinstance(question, str):
        question = normalize(question)
    else:
        question = [{**m, "content": normalize(m["content"])} for m in question]
    return question, normalize(system) if system else system


def open_prompt(s, question: str | Messages, profile: ModelProfile,
                system: str | None = None) -> None:
    """System (optional) and user turns (or the chat turns of ``question``, a list of
    messages), the profile's answer format after the last user turn, then the assistant turn
    opened for generation."""
    import sglang as sgl

    turns = [{"role": "user", "content": question}] if isinstance(question, str) else question
    if system:
        s += sgl.system(system)
    for i, m in enumerate(turns):
        content = m["content"]
        if i == len(turns) - 1 and profile.answer_format:
            content = f"{content}\n{profile.answer_format}"
        s += getattr(sgl, m["role"])(content)
    s += sgl.assistant_begin()


def finished(s, name: str) -> tuple[str, dict]:
    """The text and meta info of the gen ``name`` on state ``s``, once it has finished.

    Where the state's executor failed (a server gone, a program cancelled), SGLang leaves the
    variable unset and keeps the exception: it is raised here, instead of a ``KeyError`` or a
    ``None`` meta info further on."""
    ex = s.stream_executor
    event = ex.variable_event.get(name)
    if event is not None:
        event.wait()
    # A streamed gen sets its variable to "" before its request starts, so a failed one
    # shows as a variable without the meta info a finished request carries.
    if name not in ex.variables or "finish_reason" not in (ex.meta_info.get(name) or {}):
        deadline = time.monotonic() + 5  # the executor records its error just after the events
        while ex.error_ is None and not ex.is_finished and time.monotonic() < deadline:
            time.sleep(0.01)
        if ex.error_ is not None:
            raise ex.error_
        if name not in ex.variables:
            raise RuntimeError(f"the program's request for {name!r} returned nothing")
    return ex.variables[name], ex.meta_info.get(name) or {}


@contextmanager
def forks(s, n: int, *, commit: bool = True) -> Iterator[list]:
    """``n`` branches of state ``s``, ended when the block is left, however it is left.

    Each branch runs an SGLang executor on a non-daemon thread that waits for more work until
    the branch is ended. SGLang ends a branch only when its state is collected, and a failed
    or cancelled program's exception holds its branches through its frames: the threads then
    outlive the call (a gateway gains n per failed call) and an interpreter exiting with the
    exception in a reference cycle waits on them forever.

    ``commit``: sync ``s`` first, so that the shared prefix is committed to the radix cache
    once. SGLang's ``fork`` checks the text before it syncs, so under the threaded executor it
    often skips the commit and every branch prefills the whole prompt."""
    if commit:
        sync(s)
    branches = list(s.fork(n))
    try:
        yield branches
    finally:
        for branch in branches:
            branch.stream_executor.end()


@contextmanager
def timed_cost(backend: ReasonBackend) -> Iterator[Callable[[], Cost]]:
    """Yields a function that returns the ledger so far with the elapsed wall time."""
    start = time.perf_counter()
    yield lambda: backend.recorder.snapshot().model_copy(
        update={"seconds": time.perf_counter() - start}
    )
