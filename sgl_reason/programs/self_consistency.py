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
from sgl_reason.early_stop import EarlyStop
from sgl_reason.early_stop.confidence import (
    CONFIDENCE_REQUEST, trace_confidence, warmup_threshold,
)
from sgl_reason.programs.chunked import decision_dict, generate_chunked, top_logprobs
from sgl_reason.profiles import ModelProfile, Sampling
from sgl_reason.programs.budget import KVPolicy, ThinkingBudget
from sgl_reason.programs.common import (
    Messages, ProgramResult, Sample, finished, forks, open_prompt, prompt_texts, resolve_backend,
    resolve_profile, sampling_kwargs, timed_cost,
)
from sgl_reason.programs.think_then_answer import think_plan_or_none
from sgl_reason.programs.think_then_answer import think as think_step
from sgl_reason.vote import VoteConfig, extract_answer, normalize_answer, vote


def collect_direct(branch, weigh: bool = False) -> Sample:
    """The sample of a branch whose ``completion`` gen has been submitted (waits for it);
    ``weigh``: the gen asked for top logprobs, and the score is the trace's confidence."""
    text, meta = finished(branch, "completion")
    cut = meta["finish_reason"]["type"] == "length"
    return Sample(text=text, answer_text=text, answer=extract_answer(text, cut=cut),
                  answer_tokens=meta["completion_tokens"],
                  finish_reason=meta["finish_reason"]["type"],
                  score=trace_confidence(top_logprobs(meta)) if weigh else None)


def _direct_watched(branch, max_tokens: int, sampling: dict, config: EarlyStop) -> Sample:
    """A direct answer generated in chunks under a per-trace signal (``confidence``)."""
    signal = config.build()
    text, used, closed, decision = generate_chunked(branch, "completion", max_tokens, None,
                                                    sampling, signal, config)
    dropped = decision is not None and decision.drop
    cut = not closed and used >= max_tokens
    return Sample(text=text, answer_text=text,
                  answer=None if dropped else extract_answer(text, cut=cut),
                  answer_tokens=used, stopped=decision_dict(decision),
                  score=0.0 if dropped else signal.weight())


@sgl.function
def self_consistency_program(s, question, num_samples, max_tokens, sampling, profile,
                             plan=None, system=None, watch=None, weigh=False):
    """Shared prompt, ``num_samples`` forks decoded concurrently; samples land in s["samples"].

    ``watch``: an ``EarlyStop`` whose per-trace signal watches direct (non-thinking) branches.
    ``weigh``: direct branches return top logprobs and score their confidence (a thinking
    ``plan`` says so itself)."""
    open_prompt(s, question, profile, system)
    if plan is not None:
        s += plan.profile.think_start  # shared: each branch then prefills a single token
    with forks(s, num_samples) as branches:
        s["samples"] = _samples(branches, plan, max_tokens, sampling, watch, weigh)


def _samples(branches, plan, max_tokens, sampling, watch, weigh) -> list[Sample]:
    if watch is not None and plan is None:
        with ThreadPoolExecutor(max_workers=len(branches)) as pool:
            return list(pool.map(
                lambda b: _direct_watched(b, max_tokens, sampling, watch), branches))
    if plan is None:
        logprobs = dict(CONFIDENCE_REQUEST) if weigh else {}
        for branch in branches:  # gen is asynchronous: all n requests are in flight at once
            branch += sgl.gen("completion", max_tokens=max_tokens, **sampling, **logprobs)
        return [collect_direct(b, weigh) for b in branches]
    # think-then-answer in every branch; branches wait on their own replies in parallel
    with ThreadPoolExecutor(max_workers=len(branches)) as pool:
        return list(pool.map(lambda b: think_step(b, plan, opened=True), branches))


def self_consistency(
    question: str | Messages,
    n: int = 8,
    *,
    max_tokens: int = 256,
    think: ThinkingBudget | int | str | None = None,
    vote_config: VoteConfig | None = None,
    backend: ReasonBackend | None = None,
    profile: ModelProfile | None = None,
    sampling: Sampling | None = None,
    system: str | None = None,
    early_stop: EarlyStop | None = None,
    kv_policy: str | KVPolicy | None = None,
    normalize_prompt: bool = True,
) -> ProgramResult:
    """Sample ``n`` answers off one shared prefill and return the voted answer.

    ``question``: a string, or chat turns (``[{"role": ..., "content": ...}, ...]``, the last
    one the user's).

    ``think``: a budget (see :func:`~sgl_reason.think`) makes every branch think first;
    ``kv_policy`` then sets the server's thinking-KV policy for that thinking.
    ``vote_config``: how answers are matched, and ``weigh="confidence"`` weighs each trace's
    vote by its confidence (its lowest 32-token group confidence, from the top-5 logprobs its
    own request returns; DeepConf offline: nothing dropped, no extra request).
    ``early_stop``: ``consensus`` samples in windows of ``batch`` and stops once the majority
    is settled (``info["early_stop"]``); ``confidence`` watches every branch, drops
    low-confidence traces and weights the vote by confidence (with ``warmup=W``, DeepConf
    online: the first W traces are drawn whole and set the threshold that keeps their top
    ``keep_top``, ``info["confidence_threshold"]``); ``entropy``/``probe`` stop each
    branch's thinking (they need ``think=``).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if early_stop is not None and early_stop.signal in ("entropy", "probe") and think is None:
        raise ValueError(f"the {early_stop.signal!r} signal stops thinking: pass think="
                         "ThinkingBudget(...) as well, or use 'confidence' or 'consensus'")
    question, system = prompt_texts(question, system, normalize_prompt)
    backend = resolve_backend(backend)
    profile = resolve_profile(backend, profile)
    params = sampling_kwargs(profile, sampling)
    per_trace = early_stop if early_stop is not None and early_stop.signal != "consensus" else None
    weigh = vote_config is not None and vote_config.weigh == "confidence"
    if weigh and per_trace is not None and per_trace.signal != "confidence":
        raise ValueError(
            f"VoteConfig(weigh='confidence') reads each trace's logprobs from its own request, "
            f"and early stop {per_trace.signal!r} splits traces into chunks: use "
            "early_stop=EarlyStop(signal='confidence'), which weighs the traces it keeps, or "
            "early_stop=EarlyStop(signal='consensus'), or none")
    # the confidence signal weighs the traces it watches itself
    weigh_requests = weigh and per_trace is None

    def sampler(watch: EarlyStop | None):
        plan = think_plan_or_none(backend, profile, think, params, watch, kv_policy,
                                  weigh_requests)
        return plan, lambda m: self_consistency_program.run(
            question=question, num_samples=m, max_tokens=max_tokens, sampling=params,
            profile=profile, plan=plan, system=system, watch=watch, weigh=weigh_requests,
            backend=backend,
        )["samples"]

    plan, run = sampler(per_trace)
    deepconf = per_trace is not None and per_trace.signal == "confidence" and per_trace.warmup > 0
    decision, threshold = None, None
    with timed_cost(backend) as cost:
        if deepconf:  # DeepConf online: warm-up traces drawn whole set the threshold
            samples = sampler(per_trace.model_copy(update={"threshold": 0.0}))[1](
                min(per_trace.warmup, n))  # confidences are >= 0: nothing is dropped
            threshold = warmup_threshold([x.score for x in samples], per_trace.keep_top)
            for x in samples:  # a warm-up trace under the threshold is filtered out too
                if x.score < threshold:
                    x.score = 0.0
            if n > len(samples):
                samples += sampler(per_trace.model_copy(update={"threshold": threshold}))[1](
                    n - len(samples))
        elif early_stop is not None and early_stop.signal == "consensus":
            samples, judge = [], early_stop.build()
            while len(samples) < n and decision is None:
                window = run(min(early_stop.batch, n - len(samples)))
                samples += window
                decision = judge.settled(
                    [normalize_answer(x.answer) if x.answer else None for x in samples],
                    [normalize_answer(x.answer) if x.answer else None for x in window],
                    len(samples))
        else:
            samples = run(n)
        total = cost()
    total.thinking_tokens = sum(x.thinking_tokens for x in samples)
    total.answer_tokens = sum(x.answer_tokens for x in samples)
    weights = None
    if weigh or (early_stop is not None and early_stop.signal == "confidence"):
        weights = [x.score if x.score is not None else 1.0 for x in samples]
    result = vote([x.answer for x in samples], vote_config, weights=weights)
    return ProgramResult(answer=result.answer, samples=samples, vote=result, cost=total,
                         info={"profile": profile.name, "route": plan.route if plan else "direct",
                               "early_stop": decision_dict(decision),
                               "samples_drawn": len(samples),
                               **({"confidence_threshold": threshold} if deepconf else {})})
