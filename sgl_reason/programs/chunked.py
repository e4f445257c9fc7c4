"""Generation in chunks with an early-stop signal watching (thinking, or a direct answer).

Each chunk is a request whose prompt is the text so far: the previous chunk's KV is in the
radix cache, so a chunk prefills only the few tokens that re-tokenization changes at the seam.
"""

from __future__ import annotations

import sglang as sgl

from sgl_reason.early_stop import Chunk, EarlyStop, Probe, Signal, StopDecision
from sgl_reason.programs.common import finished, forks


def _logprobs(meta: dict) -> tuple[list[float], list[list[float]]]:
    chosen = [float(x[0]) for x in meta.get("output_token_logprobs") or [] if x and x[0] is not None]
    return chosen, top_logprobs(meta)


def top_logprobs(meta: dict) -> list[list[float]]:
    """Per generated token, the top logprobs a request returned (``top_logprobs_num``)."""
    return [[float(y[0]) for y in (row or []) if y and y[0] is not None]
            for row in meta.get("output_top_logprobs") or []]


def generate_chunked(s, name: str, max_tokens: int, stops: list[str] | None, sampling: dict,
                     signal: Signal, config: EarlyStop, probe=None, before_chunk=None):
    """Returns (text, tokens, closed_by_model, decision). ``probe(s, drop)`` -> :class:`Probe`
    (see :func:`run_probe`);
    ``before_chunk(s)`` runs before each chunk request (e.g. to attach request extras)."""
    used, parts, k = 0, [], 0
    extra = {"return_logprob": True, "top_logprobs_num": config.top_k} if signal.needs_logprobs else {}
    while used < max_tokens:
        part = f"{name}_{k}"
        k += 1
        if before_chunk is not None:
            before_chunk(s)
        # a fresh list per request: SGLang's interpreter appends the chat template's stop
        # strings to the list it is given, so a shared one grows by a string per chunk
        # (past the server's limit of 32 in a long trace)
        s += sgl.gen(part, max_tokens=min(config.chunk_tokens, max_tokens - used),
                     stop=list(stops) if stops else stops, **sampling, **extra)
        text, meta = finished(s, part)
        used += meta["completion_tokens"]
        parts.append(text)
        chosen, top = _logprobs(meta)
        chunk = Chunk(
            text=text, tokens_so_far=used, logprobs=chosen, top_logprobs=top,
            probe=(lambda drop=0: probe(s, drop)) if probe is not None and signal.needs_probe else None,
        )
        if meta["finish_reason"]["type"] == "stop":  # the trace ended by itself
            return "".join(parts), used, True, signal.record(chunk)
        if used >= max_tokens:  # the budget closes it anyway: nothing to probe, only to judge
            return "".join(parts), used, False, signal.record(chunk)
        decision = signal.observe(chunk)
        if decision is not None:
            return "".join(parts), used, False, decision
    return "".join(parts), used, False, None


def run_probe(s, suffix: str, config: EarlyStop, drop: int = 0) -> Probe:
    """Fork the trace, close it with ``suffix`` and read a short greedy answer (with its tokens'
    logprobs, and whether it ended at a ``probe_stop`` string rather than at the token limit).
    ``drop``: read it from the trace without its last ``drop`` characters instead (a new
    request whose text is a prefix of the trace: cached but for the seam).

    The trace's newest token has no KV yet (no request has read it). It is committed alone
    first (a ``max_new_tokens=0`` request), as the next chunk would prefill it, and only then
    is the probe forked: otherwise the probe computes it inside its own, longer prefill, the
    radix cache keeps that copy, and every later chunk reads a bf16 KV rounded differently
    from the one an unprobed trace reads, which was enough to change this model's greedy
    thinking (measured without the commit: 2 of 20 problems diverged from the unprobed run)."""
    executor = s.stream_executor
    if drop:
        text = s.text()[:-drop] + suffix
        state = _probe_from.run(text=text, config=config, backend=executor.backend)
        return _read_probe(state, config)
    executor.backend.commit_lazy_operations(executor)
    with forks(s, 1, commit=False) as (fork,):
        fork += suffix
        _probe_gen(fork, config)
        return _read_probe(fork, config)


def _probe_gen(s, config: EarlyStop) -> None:
    s += sgl.gen("probe", max_tokens=config.probe_tokens, stop=list(config.probe_stop) or None,
                 temperature=0, return_logprob=True)


@sgl.function
def _probe_from(s, text: str, config: EarlyStop):
    s += text
    _probe_gen(s, config)


def _read_probe(s, config: EarlyStop) -> Probe:
    text, meta = finished(s, "probe")
    logprobs, _ = _logprobs(meta)
    cut = meta["finish_reason"]["type"] == "length" and bool(config.probe_stop)
    return Probe(text, tuple(logprobs), finished=not cut)


def decision_dict(decision: StopDecision | None) -> dict | None:
    if decision is None:
        return None
    return {"signal": decision.signal, "at_token": decision.at_token, "reason": decision.reason,
            "drop": decision.drop, "answer_from_probe": decision.answer_text is not None}
