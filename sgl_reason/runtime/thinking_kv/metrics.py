"""Prometheus series of the thinking-KV backend, written from the scheduler (rank 0) and
served by SGLang's ``/metrics`` (with ``--enable-metrics``)."""

from __future__ import annotations


class Metrics:
    """``sgl_reason:thinking_kv_tokens`` / ``answer_kv_tokens`` (held by running requests, gauges)
    and ``sgl_reason:thinking_kv_released_tokens_total`` (slots freed before their request
    finished), ``sgl_reason:thinking_kv_releases_total`` (requests released at their answer),
``sgl_reason:thinking_kv_pressure_releases_total`` (memory ran short and release-on-pressure
freed thinking KV) and ``sgl_reason:retracted_requests_total`` (SGLang retracted instead)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        if not enabled:
            return
        from prometheus_client import Counter, Gauge

        self.thinking = Gauge("sgl_reason:thinking_kv_tokens",
                              "Thinking-token KV held by running requests",
                              multiprocess_mode="mostrecent")
        self.answer = Gauge("sgl_reason:answer_kv_tokens",
                            "Answer-token KV (end marker included) held by running requests",
                            multiprocess_mode="mostrecent")
        self.released = Counter("sgl_reason:thinking_kv_released_tokens",
                                "Thinking-token KV slots freed before their request finished")
        self.releases = Counter("sgl_reason:thinking_kv_releases",
                                "Requests whose thinking KV was released at their answer")
        self.pressure = Counter("sgl_reason:thinking_kv_pressure_releases",
                                "Times memory ran short and release-on-pressure freed "
                                "thinking KV instead")
        self.retracted = Counter("sgl_reason:retracted_requests",
                                 "Requests SGLang retracted because decode ran out of KV")

    def update(self, thinking: int, answer: int, released: int = 0, releases: int = 0,
               pressure: int = 0, retracted: int = 0) -> None:
        if self.enabled:
            self.thinking.set(thinking)
            self.answer.set(answer)
            for counter, n in ((self.released, released), (self.releases, releases),
                               (self.pressure, pressure), (self.retracted, retracted)):
                if n:
                    counter.inc(n)
