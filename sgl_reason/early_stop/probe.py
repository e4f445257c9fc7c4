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

With ``probe_cues`` (DEER's trigger), a chunk is probed only when the text since the last
probed chunk contains one of the cues, the words with which the model turns from working to
checking ("Wait", or the tiny reasoner's "Check"): probes cost tokens, and before the model
has a result to check a probe only guesses. The probe reads the trace cut just before the cue
(its prefix is cached): a probe at the chunk's end would read the check half written, and a
model asked for its answer mid-check states the number it was checking.
``probe_agree=1`` with a ``probe_confidence`` stops on the first confident probe, as DEER
does.
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
        self.unprobed = ""  # text of the chunks since the last probe (cue search)

    def observe(self, chunk: Chunk) -> StopDecision | None:
        drop = self._due(chunk.text)
        if drop is None:
            return None
        probe = (chunk.probe(drop) if drop else chunk.probe()) if chunk.probe is not None else None
        self.answers.append(self._answer(probe))
        last = self.answers[-self.config.probe_agree:]
        if (len(last) == self.config.probe_agree and last[0] is not None and len(set(last)) == 1
                and chunk.tokens_so_far >= self.config.min_tokens):
            sure = (f" (mean token probability >= {self.config.probe_confidence})"
                    if self.config.probe_confidence else "")
            what = f"{len(last)} consecutive probes" if len(last) > 1 else "a probe"
            reason = f"{what}{sure} answered {last[0]!r}"
            return StopDecision("probe", chunk.tokens_so_far, reason,
                                answer_text=probe.text if self.config.answer_from_probe else None)
        return None

    def _due(self, text: str) -> int | None:
        """None: this chunk is not probed. Otherwise how many characters at the end of the
        trace the probe leaves out: 0 without cues; with cues, everything from the first cue
        in the text since the last probe (and the blank space before it), so that the probe
        reads the trace as it stood at the transition, not mid-check (a cue split across two
        chunks counts)."""
        cues = self.config.probe_cues
        if not cues:
            return 0
        self.unprobed += text
        found = [at for at in (self.unprobed.find(cue) for cue in cues) if at >= 0]
        if not found:
            self.unprobed = self.unprobed[-max(map(len, cues)):]  # a cue may straddle chunks
            return None
        at = min(found)
        while at > 0 and self.unprobed[at - 1].isspace():
            at -= 1
        drop = len(self.unprobed) - at
        self.unprobed = ""
        return drop

    def _answer(self, probe: Probe | None) -> str | None:
        if (probe is None or not probe.text.strip() or not probe.finished
                or probe.confidence < self.config.probe_confidence):
            return None
        answer = extract_answer(probe.text)
        return normalize_answer(answer) if answer else None
