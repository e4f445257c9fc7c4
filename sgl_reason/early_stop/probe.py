"""``probe``: ask for the answer every chunk; stop once it no longer changes (Dynasor-CoT style).

After each chunk a probe is forked off the trace (its text so far is a cached prefix): the
end-of-thinking marker plus the profile's answer probe, then at most ``probe_tokens`` greedy
tokens, up to the first ``probe_stop`` string. Stop when the last ``probe_agree`` probes extract
the same answer. With ``answer_from_probe`` (the default) that answer is the trace's answer and
no answer request follows: the probe already paid for it.
"""

from __future__ import annotations

from sgl_reason.early_stop.base import Chunk, Signal, StopDecision, register
from sgl_reason.vote import extract_answer, normalize_answer


@register("probe")
class ProbeSignal(Signal):
    needs_probe = True

    def __init__(self, config):
        super().__init__(config)
        self.answers: list[str | None] = []

    def observe(self, chunk: Chunk) -> StopDecision | None:
        text = chunk.probe() if chunk.probe is not None else ""
        answer = extract_answer(text) if text.strip() else None
        self.answers.append(normalize_answer(answer) if answer else None)
        last = self.answers[-self.config.probe_agree:]
        if (len(last) == self.config.probe_agree and last[0] is not None and len(set(last)) == 1
                and chunk.tokens_so_far >= self.config.min_tokens):
            return StopDecision("probe", chunk.tokens_so_far,
                                f"{len(last)} consecutive probes answered {last[0]!r}",
                                answer_text=text if self.config.answer_from_probe else None)
        return None
