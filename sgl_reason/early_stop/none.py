"""``none``: never stops. The full-budget baseline, chunked exactly like the signals it is
compared with (re-tokenizing text at chunk seams can change a greedy continuation, so a
one-request baseline would mix that effect into the signals' agreement)."""

from __future__ import annotations

from sgl_reason.early_stop.base import Chunk, Signal, StopDecision, register


@register("none")
class NoSignal(Signal):
    def observe(self, chunk: Chunk) -> StopDecision | None:
        return None
