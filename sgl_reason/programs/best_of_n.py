"""Best-of-N with a verifier.

N candidates decode off one shared prefill (as in self-consistency); each is then scored by a
verifier and the best-scored candidate wins.

Verifier: either an ``@sgl.function`` that runs *on the candidate's own state* (so its prompt
and candidate are a cached prefix: only the verifier's question is prefilled) and sets
``s["score"]``, like :func:`p_yes_verifier`; or a Python callable
``(question, candidate_text) -> float`` (a reward model, a unit test, a checker).

Stopping rule: every candidate stops at EOS or ``max_tokens`` (or by think-then-answer's rule
with ``think=``). Tie-break: highest score; among equal scores, the candidate whose extracted
answer has the most votes among all candidates; then the earliest candidate. Cost: 1 prefill +
N x (<= max_tokens decoded) + for an ``@sgl.function`` verifier N x (its own prompt tokens +
its decode), the candidates' text reused from the cache.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import sglang as sgl
from sglang.lang.ir import SglFunction

from sgl_reason.backend import ReasonBackend
from sgl_reason.profiles import ModelProfile, Sampling
from sgl_reason.programs.budget import KVPolicy, ThinkingBudget
from sgl_reason.programs.common import (
    ProgramResult, Sample, forks, open_prompt, prompt_texts, resolve_backend, resolve_profile,
    sampling_kwargs, timed_cost,
)
from sgl_reason.programs.self_consistency import collect_direct
from sgl_reason.programs.think_then_answer import think_plan_or_none
from sgl_reason.programs.think_then_answer import think as think_step
from sgl_reason.vote import normalize_answer

Verifier = SglFunction | Callable[[str, str], float]


@sgl.function
def p_yes_verifier(s):
    """Score = P("Yes") / (P("Yes") + P("No")) for "Is the answer above correct?", read from the
    length-normalized logprobs of the two choices."""
    s += sgl.user("Is the answer above correct? Reply with Yes or No.")
    s += sgl.assistant_begin()
    s += sgl.gen("verdict", choices=["Yes", "No"])
    yes, no = s.get_meta_info("verdict")["normalized_prompt_logprobs"]
    s["score"] = 1.0 / (1.0 + math.exp(no - yes))


def _candidate(branch, plan, max_tokens, sampling) -> Sample:
    if plan is not None:
        sample = think_step(branch, plan)
    else:
        branch += sgl.gen("completion", max_tokens=max_tokens, **sampling)
        sample = collect_direct(branch)
    branch += sgl.assistant_end()
    return sample


@sgl.function
def best_of_n_program(s, question, num_candidates, max_tokens, sampling, profile, verifier,
                      plan=None, system=None):
    open_prompt(s, question, profile, system)

    def one(branch) -> Sample:
        sample = _candidate(branch, plan, max_tokens, sampling)
        if isinstance(verifier, SglFunction):
            verifier.func(branch, **verifier.bind_arguments)
            score = float(branch["score"])
        else:
            score = float(verifier(question, sample.text))
        return sample.model_copy(update={"score": score})

    with forks(s, num_candidates) as branches, ThreadPoolExecutor(len(branches)) as pool:
        s["samples"] = list(pool.map(one, branches))


def pick_best(samples: list[Sample]) -> int:
    """Index of the winner under the documented tie-break."""
    votes = Counter(normalize_answer(x.answer) for x in samples if x.answer)

    def key(i: int):
        x = samples[i]
        support = votes[normalize_answer(x.answer)] if x.answer else 0
        return (-(x.score if x.score is not None else -math.inf), -support, i)

    return min(range(len(samples)), key=key)


def best_of_n(
    question: str,
    n: int = 4,
    *,
    verifier: Verifier = p_yes_verifier,
    max_tokens: int = 256,
    think: ThinkingBudget | int | str | None = None,
    backend: ReasonBackend | None = None,
    profile: ModelProfile | None = None,
    sampling: Sampling | None = None,
    system: str | None = None,
    kv_policy: str | KVPolicy | None = None,
    normalize_prompt: bool = True,
) -> ProgramResult:
    """Sample ``n`` candidates off one shared prefill, score each, return the best."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not (isinstance(verifier, SglFunction) or callable(verifier)):
        raise TypeError(
            "verifier must be an @sgl.function that sets s['score'] or a callable "
            f"(question, candidate) -> float, got {type(verifier).__name__}"
        )
    question, system = prompt_texts(question, system, normalize_prompt)
    backend = resolve_backend(backend)
    profile = resolve_profile(backend, profile)
    params = sampling_kwargs(profile, sampling)
    plan = think_plan_or_none(backend, profile, think, params, None, kv_policy)
    with timed_cost(backend) as cost:
        state = best_of_n_program.run(
            question=question, num_candidates=n, max_tokens=max_tokens, sampling=params,
            profile=profile, verifier=verifier, plan=plan, system=system, backend=backend,
        )
        samples: list[Sample] = state["samples"]
        total = cost()
    total.thinking_tokens = sum(x.thinking_tokens for x in samples)
    total.answer_tokens = sum(x.answer_tokens for x in samples)
    best = pick_best(samples)
    return ProgramResult(answer=samples[best].answer, samples=samples, cost=total,
                         info={"best_index": best, "profile": profile.name,
                               "route": plan.route if plan else "direct"})
