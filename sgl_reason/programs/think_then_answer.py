"""Budgeted think-then-answer.

Stopping rule: thinking stops when the model writes its end-of-thinking marker or when
``max_thinking_tokens`` are spent, whichever comes first; then the marker is written (budget
forcing) and the answer gets its own ``max_answer_tokens``. Thinking that closes before
``min_thinking_tokens`` is reopened with the profile's ``wait_text``.

Routes: with a server that allows custom logit processors (``--enable-custom-logit-processor``,
on by default in ``sgl-reason serve`` on CPU), one request does it all and the server forces
the marker (:mod:`sgl_reason.programs.budget`), so the runtime sees thinking and answer as one
sequence. Otherwise (or with a minimum), each thinking segment and the answer are separate
requests that reuse the cached prefix; on a thinking-KV server the answer request declares
where its thinking starts (:func:`before_answer`), so a releasing policy frees it there too.

Tie-break: none (one sample). Cost: 1 prefill of the prompt + <= max_thinking + len(marker) +
max_answer decoded tokens (single route); the two-request route adds one prefill of the
marker's few tokens per segment, the rest is cached (under a releasing thinking-KV policy, the
answer request prefills the thinking once more, into KV it can release).
"""

from __future__ import annotations

import sglang as sgl

from sgl_reason.backend import (
    OUTPUT_IDS_KEY,
    ProgramCancelled,
    ReasonBackend,
    set_request_extras,
)
from sgl_reason.early_stop import EarlyStop
from sgl_reason.early_stop.confidence import CONFIDENCE_REQUEST, trace_confidence
from sgl_reason.programs.chunked import decision_dict, generate_chunked, run_probe, top_logprobs
from sgl_reason.profiles import ModelProfile, Sampling
from sgl_reason.programs.budget import (
    THINKING_START, BudgetForcingProcessor, KVPolicy, ThinkingBudget, as_budget,
    check_kv_policy, kv_params,
)
from sgl_reason.programs.common import (
    Messages, ProgramResult, Sample, finished, open_prompt, prompt_texts, resolve_backend,
    resolve_profile, sampling_kwargs, timed_cost,
)
from sgl_reason.tokens import find_tokens
from sgl_reason.vote import extract_answer


class ThinkPlan:
    """Everything :func:`think` needs, resolved once per program call (token ids, route)."""

    def __init__(self, backend: ReasonBackend, profile: ModelProfile, budget: ThinkingBudget,
                 sampling: dict, early_stop: EarlyStop | None = None,
                 kv_policy: str | KVPolicy | None = None, weigh: bool = False):
        self.profile, self.budget, self.sampling = profile, budget, sampling
        self.early_stop = early_stop
        # weigh: each request of the trace returns its top logprobs and the sample's score is
        # its confidence (trace_confidence), for a vote weighted by confidence; the single and
        # two-request routes only (self_consistency refuses it beside a chunking early stop)
        self.logprobs = dict(CONFIDENCE_REQUEST) if weigh else {}
        self.kv_policy = check_kv_policy(kv_policy)
        self.end_ids = backend.fixed_ids(profile.think_end)  # what budget forcing writes
        self.marker_ids = backend.fixed_ids(profile.end_marker)  # what detection matches
        if profile.end_token is not None and len(self.marker_ids) != 1:
            raise ValueError(
                f"The {profile.name!r} profile's end token {profile.end_token!r} is "
                f"{len(self.marker_ids)} tokens for the served model, not one: this model does "
                "not have it. Pass the profile of the served model (profile=...)."
            )
        # where the marker token sits in the forced text ("\n" then "</think>": 1)
        self.marker_offset = max(0, find_tokens(self.end_ids, self.marker_ids))
        self.wait_len = len(backend.fixed_ids(profile.wait_text))
        single_ok = backend.supports_logit_processor and budget.min_thinking_tokens == 0
        if budget.mode == "single" and not single_ok:
            raise ValueError(
                "mode='single' needs a server started with --enable-custom-logit-processor and "
                "min_thinking_tokens == 0; use mode='auto' to fall back to two requests."
            )
        self.route = "single" if (budget.mode != "two" and single_ok) else "two"
        if early_stop is not None and early_stop.signal != "consensus":
            early_stop.check_budget(budget.thinking_tokens)
            self.route = "chunked"  # thinking in chunks, a signal watching
        self.processor = BudgetForcingProcessor.to_str() if backend.supports_logit_processor else None
        # the answer request of the multi-request routes declares where its thinking starts,
        # so the server releases it as it does a generated marker's (needs the marker to be
        # one token: a text marker may merge with its neighbours and not be found)
        self.declare_thinking = backend.thinking_kv and profile.end_token is not None

    def params(self, custom_params: dict) -> dict:
        """A thinking request's ``custom_params``, with the plan's KV policy when it has one."""
        custom_params.update(kv_params(self.kv_policy))
        return custom_params


def think_plan_or_none(backend: ReasonBackend, profile: ModelProfile, budget, sampling: dict,
                       early_stop: EarlyStop | None,
                       kv_policy: str | KVPolicy | None, weigh: bool = False) -> ThinkPlan | None:
    """The plan of a program's ``think=`` argument (None: the program does not think)."""
    if budget is None:
        if kv_policy is not None:
            raise ValueError("kv_policy is the thinking-KV policy: pass think=<budget> as well.")
        return None
    return ThinkPlan(backend, profile, as_budget(budget), sampling, early_stop, kv_policy, weigh)


def think(
    s,
    budget: ThinkingBudget | int | str | ThinkPlan | None = None,
    *,
    early_stop: EarlyStop | None = None,
    kv_policy: str | KVPolicy | None = None,
    profile: ModelProfile | None = None,
    sampling: Sampling | None = None,
    opened: bool = False,
) -> Sample:
    """Think within ``budget``, close the thinking, answer; return the :class:`Sample`.

    The thinking primitive of every program, for use inside any ``@sgl.function``: ``s`` is the
    program state (or a fork branch), already holding the prompt with the assistant turn open.
    ``budget`` is a :class:`ThinkingBudget`, a token count or a tier (``"low"``,
    ``"medium"``, ``"high"``); default: the ``low`` tier. ``early_stop`` lets a signal end the
    thinking early (chunked route). ``kv_policy`` is the server's thinking-KV policy for this
    thinking (``keep``, ``strip``, ``demote``, ``release-on-answer``, ``release-on-pressure``,
    or a :class:`KVPolicy` that also sets what a release keeps; needs a server started with
    ``--thinking-kv-policy``); None leaves the server's default. ``profile`` and
    ``sampling`` default to the served model's.

    The budget is resolved once per call (a few cached token ids); a program that thinks in
    many branches resolves it once with :class:`ThinkPlan` and passes the plan instead.
    ``opened``: the caller already wrote the profile's ``think_start`` (before a fork, so that
    the branches share it and each prefills one token, not the marker).
    """
    if isinstance(budget, ThinkPlan):
        if early_stop is not None or kv_policy is not None or profile or sampling:
            raise ValueError("a ThinkPlan already fixes early_stop, kv_policy, profile and "
                             "sampling: pass them to ThinkPlan, or pass a budget here.")
        plan = budget
    else:
        if early_stop is not None and early_stop.signal == "consensus":
            raise ValueError("the consensus signal stops sampling, not thinking: use it with "
                             "self_consistency(early_stop=...)")
        backend = s.stream_executor.backend
        if not isinstance(backend, ReasonBackend):
            raise TypeError("sgl_reason.think needs the program to run on a ReasonBackend "
                            "(EmbeddedRuntime().endpoint, connect(), or ReasonBackend(url)), "
                            f"got {type(backend).__name__}.")
        profile = resolve_profile(backend, profile)
        plan = ThinkPlan(backend, profile, as_budget(budget),
                         sampling_kwargs(profile, sampling), early_stop, kv_policy)
    if not opened:
        s += plan.profile.think_start
    if plan.route == "single":
        return _single_request(s, plan)
    if plan.route == "chunked":
        return _chunked(s, plan)
    return _two_requests(s, plan)


def mask_eos_in_thinking(s, plan: ThinkPlan) -> None:
    """Before a thinking request of the multi-request routes: where the server runs logit
    processors, EOS is masked as in the single-request route, so that thinking ends only by
    the marker or the budget whatever the route (elsewhere an EOS ends the segment). The
    plan's thinking-KV policy rides along either way."""
    if plan.processor is not None:
        set_request_extras(s, custom_logit_processor=plan.processor,
                           custom_params=plan.params({"budget": 1 << 30, "end_ids": plan.end_ids,
                                                      "max_answer": 1}))
    elif plan.kv_policy is not None:
        set_request_extras(s, custom_params=plan.params({}))


def before_answer(s, plan: ThinkPlan, thinking_start: int | None) -> None:
    """Before the answer request of the two-request and chunked routes: on a thinking-KV
    server, declare where the thinking starts in its prompt (``thinking_start``; the server
    finds the marker after it), with the plan's policy. A releasing policy then prefills that
    thinking into the request's own KV, observes it for scored retention and releases it as on
    the single-request route; ``keep`` costs nothing."""
    if plan.declare_thinking and thinking_start is not None:
        set_request_extras(s, custom_params=plan.params({THINKING_START: thinking_start}))


def _stops(profile: ModelProfile) -> list[str]:
    return list(dict.fromkeys([profile.think_end, profile.think_end.strip(), profile.end_marker]))


def _chunked(s, plan: ThinkPlan) -> Sample:
    """Thinking in chunks of ``early_stop.chunk_tokens``; the signal may end it early."""
    b, profile, config = plan.budget, plan.profile, plan.early_stop
    signal = config.build()
    suffix = profile.think_end + ("" if not profile.native_thinking else profile.answer_probe)
    thinking, used, closed, decision = generate_chunked(
        s, "thinking", b.thinking_tokens, _stops(profile), plan.sampling, signal, config,
        probe=lambda st, drop=0: run_probe(st, suffix, config, drop),
        before_chunk=lambda st: mask_eos_in_thinking(st, plan),
    )
    thinking_start = (s.get_meta_info("thinking_0") or {}).get("prompt_tokens")
    stopped = decision_dict(decision)
    if decision is not None and decision.drop:
        return Sample(text=thinking, thinking=thinking, answer_text="", answer=None,
                      thinking_tokens=used, stopped=stopped, score=0.0)
    if decision is not None and decision.answer_text is not None:  # the settled probe answers
        return Sample(
            text=thinking + suffix + decision.answer_text, thinking=thinking,
            answer_text=decision.answer_text, answer=extract_answer(decision.answer_text),
            thinking_tokens=used, answer_tokens=0, stopped=stopped,
        )
    s += profile.think_end
    before_answer(s, plan, thinking_start)
    s += sgl.gen("answer", max_tokens=b.max_answer_tokens, **plan.sampling)
    answer_text, meta = finished(s, "answer")
    return Sample(
        text=thinking + profile.think_end + answer_text, thinking=thinking,
        answer_text=answer_text, answer=_answer(answer_text, _cut(meta)),
        thinking_tokens=used, answer_tokens=meta["completion_tokens"],
        forced=not closed and decision is None, finish_reason=meta["finish_reason"]["type"],
        stopped=stopped, score=signal.weight() if signal.needs_logprobs else None,
    )


def _single_request(s, plan: ThinkPlan) -> Sample:
    b = plan.budget
    set_request_extras(
        s, custom_logit_processor=plan.processor,
        custom_params=plan.params({"budget": b.thinking_tokens, "end_ids": plan.end_ids,
                                   "marker_ids": plan.marker_ids,
                                   "max_answer": b.max_answer_tokens}),
    )
    s += sgl.gen("completion", max_tokens=b.thinking_tokens + len(plan.end_ids)
                 + b.max_answer_tokens + 1, **plan.sampling, **plan.logprobs)
    text, meta = finished(s, "completion")
    ids = meta.get(OUTPUT_IDS_KEY) or []
    at = find_tokens(ids, plan.marker_ids)  # the marker token, however the text around it merged
    k = plan.marker_offset
    forced = at == b.thinking_tokens + k and ids[b.thinking_tokens:at] == plan.end_ids[:k]
    if at < 0:
        thinking_tokens, answer_tokens = len(ids), 0
    elif forced:
        thinking_tokens = b.thinking_tokens
        answer_tokens = len(ids) - b.thinking_tokens - len(plan.end_ids)
    else:
        thinking_tokens, answer_tokens = at, len(ids) - at - len(plan.marker_ids)
    thinking, answer_text = _split(text, plan.profile.think_end)
    return Sample(
        text=text, thinking=thinking, answer_text=answer_text,
        # the processor ends the answer with a forced EOS as its max_answer-th token
        answer=_answer(answer_text, _cut(meta) or answer_tokens >= b.max_answer_tokens),
        thinking_tokens=thinking_tokens, answer_tokens=max(0, answer_tokens),
        forced=forced, finish_reason=meta["finish_reason"]["type"],
        score=_confidence(plan, [meta]),
    )


def _confidence(plan: ThinkPlan, metas: list[dict]) -> float | None:
    """The trace's confidence over the tokens its requests generated (``plan.logprobs``)."""
    if not plan.logprobs:
        return None
    return trace_confidence([row for m in metas for row in top_logprobs(m)])


def _two_requests(s, plan: ThinkPlan) -> Sample:
    b, profile = plan.budget, plan.profile
    used, parts, k, forced, metas = 0, [], 0, False, []
    stops = _stops(profile)
    while True:
        name = f"thinking_{k}"
        mask_eos_in_thinking(s, plan)
        s += sgl.gen(name, max_tokens=b.thinking_tokens - used, stop=list(stops),  # see chunked
                     **plan.sampling, **plan.logprobs)
        text, meta = finished(s, name)
        metas.append(meta)
        if k == 0:
            thinking_start = meta.get("prompt_tokens")
        used += meta["completion_tokens"]
        parts.append(text)
        closed = meta["finish_reason"]["type"] == "stop"
        if not closed:
            forced = True
            break
        if used >= b.min_thinking_tokens or used + plan.wait_len >= b.thinking_tokens:
            break
        s += profile.wait_text  # reopen thinking that closed too early
        parts.append(profile.wait_text)
        used += plan.wait_len
        k += 1
    s += profile.think_end
    before_answer(s, plan, thinking_start)
    s += sgl.gen("answer", max_tokens=b.max_answer_tokens, **plan.sampling, **plan.logprobs)
    answer_text, meta = finished(s, "answer")
    thinking = "".join(parts)
    return Sample(
        text=thinking + profile.think_end + answer_text, thinking=thinking,
        answer_text=answer_text, answer=_answer(answer_text, _cut(meta)),
        thinking_tokens=used, answer_tokens=meta["completion_tokens"],
        forced=forced, finish_reason=meta["finish_reason"]["type"],
        score=_confidence(plan, metas + [meta]),
    )


def _cut(meta: dict) -> bool:
    return meta["finish_reason"]["type"] == "length"


def _answer(text: str, cut: bool) -> str | None:
    """The answer in a generated answer, read knowing whether its token limit cut it."""
    return extract_answer(text, cut=cut) if text.strip() else None


def _split(text: str, marker: str) -> tuple[str, str]:
    for m in (marker, marker.strip()):
        at = text.find(m)
        if at >= 0:
            return text[:at], text[at + len(m):]
    return text, ""


@sgl.function
def think_then_answer_program(s, question, plan, system=None):
    """One question: prompt, think within the budget, close, answer."""
    open_prompt(s, question, plan.profile, system)
    try:
        s["sample"] = think(s, plan)
    except ProgramCancelled as e:
        ex = s.stream_executor
        if not ex.stream:
            raise
        # Streamed (the gateway): SGLang runs this function on a thread of its own and the
        # caller reads ``ex.error_``; raising here would only print a thread traceback each
        # time a client leaves.
        ex.error_ = ex.error_ or e


def think_then_answer(
    question: str | Messages,
    *,
    budget: ThinkingBudget | None = None,
    backend: ReasonBackend | None = None,
    profile: ModelProfile | None = None,
    sampling: Sampling | None = None,
    system: str | None = None,
    early_stop: EarlyStop | None = None,
    kv_policy: str | KVPolicy | None = None,
    normalize_prompt: bool = True,
) -> ProgramResult:
    """Think within ``budget`` (default: the ``low`` tier, 4k tokens), then answer.

    ``question``: a string, or chat turns (``[{"role": ..., "content": ...}, ...]``, the last
    one the user's).

    With ``early_stop`` (``entropy``, ``probe`` or ``confidence``) thinking is generated in
    chunks and the signal may close it before the budget; ``samples[0].stopped`` says which
    signal stopped it, at which token and why. ``kv_policy``: see :func:`think`.
    """
    if early_stop is not None and early_stop.signal == "consensus":
        raise ValueError("the consensus signal stops sampling, not thinking: use it with "
                         "self_consistency(early_stop=...)")
    question, system = prompt_texts(question, system, normalize_prompt)
    backend = resolve_backend(backend)
    profile = resolve_profile(backend, profile)
    plan = ThinkPlan(backend, profile, as_budget(budget), sampling_kwargs(profile, sampling),
                     early_stop, kv_policy)
    with timed_cost(backend) as cost:
        state = think_then_answer_program.run(question=question, plan=plan, system=system,
                                              backend=backend)
        sample: Sample = state["sample"]
        total = cost()
    total.thinking_tokens, total.answer_tokens = sample.thinking_tokens, sample.answer_tokens
    return ProgramResult(answer=sample.answer, samples=[sample], cost=total,
                         info={"route": plan.route, "profile": profile.name,
                               "marker_tokens": len(plan.end_ids), "early_stop": sample.stopped})
