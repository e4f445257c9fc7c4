"""``entropy``: stop thinking when the model has become certain.

Mean entropy of the next-token distribution (top-k, renormalized) over the last ``window``
generated tokens; stop when it falls under ``threshold`` (default 0.1 nats).
"""

from __future__ import annotations

from sgl_reason.early_stop.base import Chunk, Signal, StopDecision, register, token_entropies


@register("entropy")
class EntropySignal(Signal):
    needs_logprobs = True

    def __init__(self, config):
        super().__init__(config)
        self.history: list[float] = []

    def observe(self, chunk: Chunk) -> StopDecision | None:
        self.history.extend(token_entropies(chunk.top_logprobs))
        window = self.history[-self.config.window:]
        if len(window) < self.config.window or chunk.tokens_so_far < self.config.min_tokens:
            return None
        mean = sum(window) / len(window)
        if mean < self.config.effective_threshold:
            return StopDecision("entropy", chunk.tokens_so_far,
                                f"mean entropy {mean:.3f} < {self.config.effective_threshold} "
                                f"over the last {len(window)} tokens")
        return None
