"""``confidence``: DeepConf-style per-trace confidence.

Token confidence = minus the mean of the top-k logprobs at that position (high when the
distribution is peaked). Group confidence = mean token confidence over a sliding ``window``.
A trace whose group confidence falls under ``threshold`` is stopped and dropped (a trace that
ended by itself is dropped by the same rule; one shorter than a window is judged on its mean);
a kept trace votes with the weight of its lowest group confidence.

DeepConf online (``warmup`` > 0, in self-consistency): the threshold is not fixed but set per
question from its first ``warmup`` traces, drawn whole: :func:`warmup_threshold` is the
confidence that keeps their top ``keep_top`` fraction.

:func:`trace_confidence` is the same weight read off a finished trace's logprobs at once: a
self-consistency vote weighted by confidence without early stop (``VoteConfig(weigh=
"confidence")``, DeepConf offline) asks for them in the trace's own request, with no chunks.
"""

from __future__ import annotations

from sgl_reason.early_stop.base import Chunk, Signal, StopDecision, register


@register("confidence")
class ConfidenceSignal(Signal):
    needs_logprobs = True

    def __init__(self, config):
        super().__init__(config)
        self.tokens: list[float] = []
        self.lowest: float | None = None

    def record(self, chunk: Chunk) -> StopDecision | None:
        return self.observe(chunk)  # a finished trace below the threshold is dropped too

    def _update(self, chunk: Chunk) -> None:
        before = len(self.tokens)
        self.tokens.extend(token_confidences(chunk.top_logprobs))
        w = self.config.window
        if len(self.tokens) < w:  # shorter than one group: the mean so far
            self.lowest = sum(self.tokens) / len(self.tokens) if self.tokens else None
            return
        for end in range(max(w, before), len(self.tokens) + 1):
            group = sum(self.tokens[end - w:end]) / w
            self.lowest = group if self.lowest is None else min(self.lowest, group)

    def observe(self, chunk: Chunk) -> StopDecision | None:
        self._update(chunk)
        return self._judge(chunk)

    def _judge(self, chunk: Chunk) -> StopDecision | None:
        if (self.lowest is not None and self.lowest < self.config.effective_threshold
                and chunk.tokens_so_far >= self.config.min_tokens):
            return StopDecision("confidence", chunk.tokens_so_far,
                                f"group confidence {self.lowest:.3f} < "
                                f"{self.config.effective_threshold}", drop=True)
        return None

    def weight(self) -> float:
        return self.lowest if self.lowest is not None else 1.0


# what a trace weighed by confidence without early stop is read with: EarlyStop's defaults
CONFIDENCE_TOP_K, CONFIDENCE_WINDOW = 5, 32
# the gen arguments whose reply carries what trace_confidence reads
CONFIDENCE_REQUEST = {"return_logprob": True, "top_logprobs_num": CONFIDENCE_TOP_K}
# Under this a logprob is a masked token's: the server reports -inf as float32's lowest
# (-3.4e38), and a token that a logit processor forced (budget forcing's marker, an answer's
# last EOS) has one real logprob (0.0) beside masked ones.
MASKED_LOGPROB = -1e4


def token_confidences(top_logprobs: list[list[float]]) -> list[float]:
    """Per token, minus the mean of its top logprobs; a token forced by a logit processor is
    left out: it is the processor's choice, not the model's (with its masked neighbours'
    -3.4e38 it read as a confidence of 2.7e38, and the window sums lost every other digit)."""
    out = []
    for lps in top_logprobs:
        real = [x for x in lps if x > MASKED_LOGPROB]
        if len(real) > 1:
            out.append(-sum(real) / len(real))
    return out


def trace_confidence(top_logprobs: list[list[float]],
                     window: int = CONFIDENCE_WINDOW) -> float | None:
    """A finished trace's lowest mean token confidence over ``window`` consecutive tokens (its
    mean where it is shorter): what :class:`ConfidenceSignal` weighs it by after reading the
    same tokens. None when no token has logprobs."""
    conf = token_confidences(top_logprobs)
    if len(conf) < window:
        return sum(conf) / len(conf) if conf else None
    group = sum(conf[:window])
    lowest = group
    for end in range(window, len(conf)):
        group += conf[end] - conf[end - window]
        lowest = min(lowest, group)
    return lowest / window


def warmup_threshold(confidences: list[float], keep_top: float) -> float:
    """The group confidence that keeps the top ``keep_top`` fraction of ``confidences``: their
    ``100 * (1 - keep_top)``-th percentile, linearly interpolated (DeepConf's threshold)."""
    if not confidences:
        raise ValueError("no warm-up trace has a confidence to set the threshold from")
    xs = sorted(confidences)
    at = (len(xs) - 1) * (1 - keep_top)
    lo = int(at)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (at - lo)
