"""Thinking-aware KV: a reasoning request's thinking KV is the first to go.

One concern per module:

| module      | concern |
|-------------|---------|
| ``policy``  | the per-server / per-request :class:`Policy`, which row columns a release frees (range table), a budgeted request's peak KV |
| ``columns`` | freed-column bookkeeping: which columns of a live row went back to the allocator, never freed twice, rows read without them |
| ``scoring`` | scored retention's observation window: attention paid to each thinking token by the last decode steps |
| ``cache``   | the radix cache backend ``sgl-reason``: policies at finish, release while running, release under memory pressure |
| ``admission`` | each request's policy or its 400; charging a releasing request its real peak |
| ``metrics`` | Prometheus series |
| ``launch``  | flags and launch-time refusals |

:func:`install` (the ``sgl_reason`` plugin) wires them into SGLang's scheduler, batch and pool
accounting; :func:`forward_inputs` is what the attention backend reads, by request-pool row.
Per-request override, in ``sampling_params.custom_params``: ``thinking_kv_policy``,
``thinking_kv_window``, ``thinking_kv_sink``, ``thinking_kv_keep``, ``thinking_kv_score``,
``thinking_kv_observe``; and ``thinking_start`` (the declared route: the prompt already holds
the thinking from that position and the server's end marker after it, as in the answer request
of the two-request and chunked routes; that thinking is re-prefilled and released).
"""

from __future__ import annotations

from sgl_reason.runtime.thinking_kv import cache as _cache
from sgl_reason.runtime.thinking_kv.launch import BACKEND
from sgl_reason.runtime.thinking_kv.policy import (
    DEFAULT_OBSERVE,
    DEFAULT_SINK,
    DEFAULT_WINDOW,
    POLICIES,
    Policy,
    columns_to_free,
    parse_keep,
    peak_output_kv,
    release_span,
)

__all__ = ["BACKEND", "DEFAULT_OBSERVE", "DEFAULT_SINK", "DEFAULT_WINDOW", "POLICIES", "Policy",
           "columns_to_free", "forward_inputs", "install", "parse_keep", "peak_output_kv",
           "release_span"]


def forward_inputs(lanes: list[int]):
    """For the attention backend, per request-pool row of a forward: its freed columns (a
    list of sorted int64 tensors or None; None when no row has any) and the observed
    requests' (batch positions, ScoreBooks) (or None)."""
    cache = _cache.current()
    return (None, None) if cache is None else cache.forward_inputs(lanes)


def install() -> None:
    """Flags and validation (every process), the backend and its hooks (used by the scheduler)."""
    from sglang.srt.managers import schedule_batch, scheduler
    from sglang.srt.managers.scheduler_components import (
        invariant_checker,
        pool_stats_observer,
    )
    from sglang.srt.mem_cache.registry import (
        get_radix_cache_factory,
        register_radix_cache_backend,
    )
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from sgl_reason.runtime.flags import wrap_server_args
    from sgl_reason.runtime.thinking_kv import admission, launch

    wrap_server_args("thinking_kv", launch.add_cli_flags, launch.validate, launch.prepare)
    if get_radix_cache_factory(BACKEND) is None:
        register_radix_cache_backend(BACKEND, _cache.build_cache)

    req_cls = schedule_batch.Req
    if getattr(req_cls, "_sgl_reason_kv_hooks", False):
        return
    stock_req_init = req_cls.__init__

    def req_init(self, *args, **kwargs):
        stock_req_init(self, *args, **kwargs)
        admission.attach_state(self)

    req_cls.__init__ = req_init

    stock_max_prefix = req_cls._compute_max_prefix_len

    def compute_max_prefix_len(self, input_len):
        limit = stock_max_prefix(self, input_len)
        cache = _cache.current()
        return limit if cache is None else cache.cap_prefix(self, limit)

    req_cls._compute_max_prefix_len = compute_max_prefix_len

    scheduler_cls = scheduler.Scheduler
    stock_process = scheduler_cls.process_batch_result

    def process_batch_result(self, batch, result, *args, **kwargs):
        out = stock_process(self, batch, result, *args, **kwargs)
        cache = _cache.current()
        decode = batch.forward_mode.is_decode()
        if cache is not None and self.tree_cache is cache and decode and cache.after_decode(
                batch.reqs):
            # SGLang stops admitting after a failed admission until a request leaves;
            # released KV is room too, so admission is tried again.
            self.running_batch.batch_is_full = False
        return out

    scheduler_cls.process_batch_result = process_batch_result

    stock_init_new = ForwardBatch.init_new.__func__

    def init_new(cls, batch, model_runner, **kwargs):
        forward_batch = stock_init_new(cls, batch, model_runner, **kwargs)
        cache = _cache.current()
        if cache is not None:
            mode = batch.forward_mode
            if mode.is_decode():
                cache.prepare_forward(batch.reqs, forward_batch.seq_lens.tolist(), None)
            elif mode.is_extend() and forward_batch.extend_prefix_lens is not None:
                cache.prepare_forward(batch.reqs, forward_batch.seq_lens.tolist(),
                                      forward_batch.extend_prefix_lens.tolist())
            else:
                cache.prepare_forward([], [], None)
        return forward_batch

    ForwardBatch.init_new = classmethod(init_new)

    admission.install_admission()
    _install_pressure(schedule_batch.ScheduleBatch)

    # SGLang's pool accounting (busy-time leak check, /v1/loads, metrics) counts a request's
    # private KV as its row past the protected prefix; freed columns are not held any more.
    stock_private = pool_stats_observer.kv_private_tokens

    def kv_private_tokens(kv, page_size):
        tokens = stock_private(kv, page_size)
        cache = _cache.current()
        return tokens - cache.released_slots(kv) if cache is not None else tokens

    for module in (pool_stats_observer, invariant_checker):
        if getattr(module, "kv_private_tokens", None) is stock_private:
            module.kv_private_tokens = kv_private_tokens
    req_cls._sgl_reason_kv_hooks = True


def _install_pressure(batch_cls) -> None:
    """release-on-pressure: when the next decode step does not fit, free pending thinking KV
    (lowest score first) before SGLang retracts a request; count the retractions that still
    happen."""
    stock_check, stock_retract = batch_cls.check_decode_mem, batch_cls.retract_decode

    def check_decode_mem(self, selected_indices=None):
        fits = stock_check(self, selected_indices)
        cache = _cache.current()
        if fits or cache is None or self.tree_cache is not cache:
            return fits
        reqs = self.reqs if selected_indices is None else [self.reqs[i] for i in
                                                            selected_indices]
        step = 2 * max(1, len(reqs))  # a decode step needs one slot a request; some margin
        while not fits and cache.relieve(reqs, step):
            fits = stock_check(self, selected_indices)
        return fits

    def retract_decode(self, *args, **kwargs):
        out = stock_retract(self, *args, **kwargs)
        cache = _cache.current()
        if cache is not None and self.tree_cache is cache and out[0]:
            cache._publish(retracted=len(out[0]))
        return out

    batch_cls.check_decode_mem = check_decode_mem
    batch_cls.retract_decode = retract_decode
