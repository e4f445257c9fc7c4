"""``consensus``: sample self-consistency in windows; stop once the majority is settled.

After each window of ``batch`` samples: stop if the window was unanimous (ESC), or if, with
``a`` votes for the leading answer and ``b`` for all others, the Beta(a+1, b+1) posterior puts
at least ``confidence_level`` of its mass on a majority share above 1/2 (Adaptive-Consistency).
The per-trace ``observe`` never stops a trace: consensus acts between windows.
"""

from __future__ import annotations

from collections import Counter

from sgl_reason.early_stop.base import Chunk, Signal, StopDecision, register


def beta_majority_mass(a: int, b: int, steps: int = 2000) -> float:
    """P(p > 1/2) for p ~ Beta(a+1, b+1), by the midpoint rule (no SciPy needed)."""
    import math

    log_norm = math.lgamma(a + b + 2) - math.lgamma(a + 1) - math.lgamma(b + 1)
    total = 0.0
    for i in range(steps // 2, steps):
        p = (i + 0.5) / steps
        total += math.exp(log_norm + a * math.log(p) + b * math.log(1 - p))
    return total / steps


@register("consensus")
class ConsensusSignal(Signal):
    def observe(self, chunk: Chunk) -> StopDecision | None:
        return None

    def settled(self, answers: list[str | None], window: list[str | None], n: int) -> StopDecision | None:
        """Called by self_consistency after each window; ``answers`` are all normalized so far."""
        counts = Counter(a for a in answers if a is not None)
        if not counts:
            return None
        leader, a = counts.most_common(1)[0]
        if len(window) > 1 and all(x == leader for x in window):
            return StopDecision("consensus", n, f"window of {len(window)} unanimous on {leader!r}")
        b = sum(counts.values()) - a
        mass = beta_majority_mass(a, b)
        if mass >= self.config.confidence_level:
            return StopDecision("consensus", n, f"P(majority {leader!r}) = {mass:.3f} "
                                f">= {self.config.confidence_level} ({a} vs {b})")
        return None
