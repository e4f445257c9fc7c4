"""What the programs share: result models, backend resolution, prompt opening, sampling."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import BaseModel, ConfigDict

from sgl_reason.backend import ReasonBackend
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
    if s.ignore_eos:
        kwargs["ignore_eos"] = True
    return kwargs


def prompt_texts(question: str, system: str | None, normalize_prompt: bool
                 ) -> tuple[str, str | None]:
    """The question and system text a program sends: normalized (:mod:`sgl_reason.normalization`)
    unless the caller opted out, so drifted copies of one prompt share its cached prefix."""
    if not normalize_prompt:
        return question, system
    from sgl_reason.normalization import normalize

    return normalize(question), normalize(system) if system else system


def open_prompt(s, question: str, profile: ModelProfile, system: str | None = None) -> None:
    """System (optional) and user turns, then the assistant turn opened for generation."""
    import sglang as sgl

    if system:
        s += sgl.system(system)
    s += sgl.user(f"{question}\n{profile.answer_format}" if profile.answer_format else question)
    s += sgl.assistant_begin()


@contextmanager
def timed_cost(backend: ReasonBackend) -> Iterator[Callable[[], Cost]]:
    """Yields a function that returns the ledger so far with the elapsed wall time."""
    start = time.perf_counter()
    yield lambda: backend.recorder.snapshot().model_copy(
        update={"seconds": time.perf_counter() - start}
    )
