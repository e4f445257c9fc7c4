"""``probe``: ask for the answer every chunk; stop once it no longer changes (Dynasor-CoT style).

After each chunk a probe is forked off the trace (its text so far is a cached prefix): the
end-of-thinking marker plus the profile's answer probe, then at most ``probe_tokens`` greedy
tokens, up to the first ``probe_stop`` string. Stop when the last ``probe_agree`` probes extract
the same answer. With ``answer_from_probe`` (the default) that answer is the trace's answer and
no answer request follows: the probe already paid for it.

A probe states no answer (and breaks a run of equal ones) when it ran out of ``probe_tokens``
before its stop string (an unfinished line is not a stated answer), or when the geometric-mean
probability of its tokens is under ``probe_confidence``: the model answering "100" while unsure
is how a weak model's probes agree by accident (docs/benchmarks.md, early stop).
"""

from __future__ import annotations

from sgl_reason.early_stop.base import Chunk, Probe, Signal, StopDecision, register
from sgl_reason.vote import extract_answer, normalize_answer


@register("probe")
class ProbeSignal(Signal):
    needs_probe = True

    def __init__(self, config):
        super().__init__(config)
        self.answers: list[str | None] = []

    def observe(self, chunk: Chunk) -> StopDecision | None:
        probe = chunk.probe() if chunk.probe is not None else None
        self.answers.append(self._answer(probe))
        last = self.answers[-self.config.probe_agree:]
        if (len(last) == self.config.probe_agree and last[0] is not None and len(set(last)) == 1
                and chunk.tokens_so_far >= self.config.min_tokens):
            sure = (f" (mean token probability >= {self.config.probe_confidence})"
                    if self.config.probe_confidence else "")
            reason = f"{len(last)} consecutive probes{sure} answered {last[0]!r}"
            return StopDecision("probe", chunk.tokens_so_far, reason,
                                answer_text=probe.text if self.config.answer_from_probe else None)
        return None

    def _answer(self, probe: Probe | None) -> str | None:
        if (probe is None or not probe.text.strip() or not probe.finished
                or probe.confidence < self.config.probe_confidence):
            return None
        answer = extract_answer(probe.text)
        return normalize_answer(answer) if answer else None
