"""Prefix-shared self-consistency.

The prompt is prefilled once and committed to the radix cache; ``fork(n)`` branches then decode
as one batch, each reusing the whole prompt, and their extracted answers are voted on.

Stopping rule: each branch stops at EOS or ``max_tokens`` (or, with ``think=``, by the
think-then-answer rule of :mod:`.think_then_answer`). Tie-break: the voter's (default exact:
the answer first seen in branch order wins a tie). Cost: 1 prefill of the prompt + n x (about
one token of prefill + <= max_tokens decoded); the ledger shows the measured numbers.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import sglang as sgl

from sgl_reason.backend import ReasonBackend
from sgl_reason.profiles import ModelProfile, Sampling
from sgl_reason.programs.budget import ThinkingBudget
from sgl_reason.programs.common import (
    ProgramResult, Sample, open_prompt, resolve_backend, resolve_profile, sampling_kwargs,
    timed_cost,
)
from sgl_reason.programs.think_then_answer import ThinkPlan, think_into
from sgl_reason.vote import VoteConfig, extract_answer, vote


def fork_shared(s, n: int):
    """Fork after committing the prefix. SGLang's ``fork`` checks the text before it syncs, so
    under the threaded executor it often skips the commit and every branch prefills the whole
    prompt; syncing first makes the commit happen."""
    s.sync()
    return s.fork(n)


def _collect(branch) -> Sample:
    text, meta = branch["completion"], branch.get_meta_info("completion")
    return Sample(text=text, answer_text=text, answer=extract_answer(text),
                  answer_tokens=meta["completion_tokens"],
                  finish_reason=meta["finish_reason"]["type"])


@sgl.function
def self_consistency_program(s, question, num_samples, max_tokens, sampling, profile,
                             plan=None, system=None):
    """Shared prompt, ``num_samples`` forks decoded concurrently; samples land in s["samples"]."""
    open_prompt(s, question, profile, system)
    branches = fork_shared(s, num_samples)
    if plan is None:
        for branch in branches:  # gen is asynchronous: all n requests are in flight at once
            branch += sgl.gen("completion", max_tokens=max_tokens, **sampling)
        s["samples"] = [_collect(b) for b in branches]
    else:  # think-then-answer in every branch; branches wait on their own replies in parallel
        with ThreadPoolExecutor(max_workers=num_samples) as pool:
            s["samples"] = list(pool.map(lambda b: think_into(b, plan), branches))


def self_consistency(
    question: str,
    n: int = 8,
    *,
    max_tokens: int = 256,
    think: ThinkingBudget | None = None,
    vote_config: VoteConfig | None = None,
    backend: ReasonBackend | None = None,
    profile: ModelProfile | None = None,
    sampling: Sampling | None = None,
    system: str | None = None,
) -> ProgramResult:
    """Sample ``n`` answers off one shared prefill and return the voted answer."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    backend = resolve_backend(backend)
    profile = resolve_profile(backend, profile)
    params = sampling_kwargs(profile, sampling)
    plan = ThinkPlan(backend, profile, think, params) if think is not None else None
    with timed_cost(backend) as cost:
        state = self_consistency_program.run(
            question=question, num_samples=n, max_tokens=max_tokens, sampling=params,
            profile=profile, plan=plan, system=system, backend=backend,
        )
        samples: list[Sample] = state["samples"]
        total = cost()
    total.thinking_tokens = sum(x.thinking_tokens for x in samples)
    total.answer_tokens = sum(x.answer_tokens for x in samples)
    result = vote([x.answer for x in samples], vote_config)
    return ProgramResult(answer=result.answer, samples=samples, vote=result, cost=total,
                         info={"profile": profile.name, "route": plan.route if plan else "direct"})
