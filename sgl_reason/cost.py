"""The cost ledger every program result carries, and the recorder that fills it."""

from __future__ import annotations

import threading

from pydantic import BaseModel, ConfigDict


class Cost(BaseModel):
    """What one program call (or a batch of them, by ``+``) cost the server.

    Token counts come from the server's ``meta_info``, never from client-side estimates.
    """

    model_config = ConfigDict(extra="forbid")

    requests: int = 0  # HTTP /generate requests sent (prefix commits included)
    prompt_tokens: int = 0  # prompt tokens over all requests
    cached_tokens: int = 0  # of those, reused from the server's radix cache
    computed_prefill_tokens: int = 0  # prompt_tokens - cached_tokens: prefill actually computed
    decode_tokens: int = 0  # tokens generated over all requests
    thinking_tokens: int = 0  # generated tokens inside thinking (set by the program)
    answer_tokens: int = 0  # generated tokens after thinking (set by the program)
    seconds: float = 0.0  # wall time of the call
    # Estimate of KV held: per request, (its newly computed prompt tokens + half its generated
    # tokens, as the KV grows linearly) x its end-to-end latency. A cached prefix shared with
    # other requests is counted once, by the request that computed it.
    kv_token_seconds: float = 0.0
    # The most KV one request held: its prompt plus what it generated, over all requests
    # (combined by max, not summed): the peak a sequential program puts on the pool.
    peak_request_tokens: int = 0

    def __add__(self, other: "Cost") -> "Cost":
        values = {k: getattr(self, k) + getattr(other, k) for k in Cost.model_fields}
        values["peak_request_tokens"] = max(self.peak_request_tokens, other.peak_request_tokens)
        return Cost(**values)

    def __radd__(self, other):
        return self if other == 0 else NotImplemented  # so that sum(costs) works


class CostRecorder:
    """Thread-safe accumulator for one program call (fork branches run in their own threads)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._cost = Cost()

    def record(self, meta_info: dict) -> None:
        prompt = int(meta_info.get("prompt_tokens", 0))
        cached = int(meta_info.get("cached_tokens", 0))
        completion = int(meta_info.get("completion_tokens", 0))
        latency = float(meta_info.get("e2e_latency") or 0.0)
        with self._lock:
            c = self._cost
            c.requests += 1
            c.prompt_tokens += prompt
            c.cached_tokens += cached
            c.computed_prefill_tokens += prompt - cached
            c.decode_tokens += completion
            c.kv_token_seconds += (prompt - cached + completion / 2) * latency
            c.peak_request_tokens = max(c.peak_request_tokens, prompt + completion)

    def snapshot(self) -> Cost:
        with self._lock:
            return self._cost.model_copy()
