"""Thinking-aware KV: a reasoning request's thinking KV is the first to go.

Radix cache backend ``sgl-reason`` (``--radix-cache-backend sgl-reason``, implied by
``--thinking-kv-policy``), with four policies, per server or per request:

| policy              | while the request runs                  | at finish                      |
|---------------------|-----------------------------------------|--------------------------------|
| ``keep``            | stock SGLang                            | stock: the whole sequence is inserted into the tree |
| ``strip``           | stock                                   | only the prompt stays in the tree; thinking and answer KV are freed |
| ``demote``          | stock                                   | inserted, but everything after the prompt is evicted before any other node |
| ``release-on-answer``| once the end-of-thinking marker is generated, thinking KV but its first S and last W tokens goes back to the allocator | the rest is freed; nothing after the prompt enters the tree |

``release-on-answer`` leaves a *hole* in the request's ``req_to_token`` row instead of compacting
it: sequence lengths, ``kv_allocated_len`` / ``kv_committed_len`` and therefore RoPE positions
stay on the logical token count, and nothing in SGLang's scheduler moves. The hole columns are
pointed at slot 0 (SGLang's padding slot, never allocated) once freed; the attention backend
(``cpu_attention``) gathers each request's row without its hole, and every code path that frees
a row range subtracts the hole (``ThinkingKVCache.free_kv_row``), so no slot is freed twice.
The forward that is in flight when the marker is seen (overlap scheduling) still reads the
whole thinking; the hole applies from the next batch on.

Admission: SGLang charges a request its whole ``max_new_tokens``. A release-on-answer request
that declares its shape (budget forcing's ``custom_params``) is charged its real peak instead
(:func:`peak_output_kv`, :func:`_install_admission`), so the room its release will make is
already used when it is admitted.

Per-request override, in ``sampling_params.custom_params``: ``thinking_kv_policy``,
``thinking_kv_window``, ``thinking_kv_sink``. Metrics on ``/metrics`` (with
``--enable-metrics``): ``sgl_reason:thinking_kv_tokens``, ``sgl_reason:answer_kv_tokens``
(held by running requests) and ``sgl_reason:thinking_kv_released_tokens_total``.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass

from sgl_reason.runtime.flags import export_to, has_flag, wrap_server_args

logger = logging.getLogger(__name__)

BACKEND = "sgl-reason"
POLICIES = ("keep", "strip", "demote", "release-on-answer")
DEFAULT_WINDOW = 16
DEFAULT_SINK = 4
# A node priority below any a request can carry (SGLang's default is 0, prompts get +1).
DEMOTED_PRIORITY = -(1 << 62)
ENV = {
    "policy": "SGL_REASON_THINKING_KV_POLICY",
    "window": "SGL_REASON_THINKING_KV_WINDOW",
    "sink": "SGL_REASON_THINKING_KV_SINK",
    "think_end": "SGL_REASON_THINK_END",
}
# custom_params keys of the per-request override
REQUEST_KEYS = {"policy": "thinking_kv_policy", "window": "thinking_kv_window",
                "sink": "thinking_kv_sink"}


@dataclass(frozen=True)
class Policy:
    name: str = "keep"
    window: int = DEFAULT_WINDOW
    sink: int = DEFAULT_SINK

    def __post_init__(self):
        if self.name not in POLICIES:
            raise ValueError(f"Unknown thinking-KV policy {self.name!r}. Supported: "
                             f"{', '.join(POLICIES)}.")
        for what, value in (("window", self.window), ("sink", self.sink)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"thinking-KV {what} must be an integer >= 0, got {value!r}.")

    @classmethod
    def from_env(cls) -> Policy:
        return cls(os.environ.get(ENV["policy"], "keep"),
                   int(os.environ.get(ENV["window"], DEFAULT_WINDOW)),
                   int(os.environ.get(ENV["sink"], DEFAULT_SINK)))

    def override(self, custom_params: dict | None) -> Policy:
        """This policy with a request's ``custom_params`` keys applied (ValueError if bad)."""
        if not custom_params or not any(k in custom_params for k in REQUEST_KEYS.values()):
            return self
        return Policy(custom_params.get(REQUEST_KEYS["policy"], self.name),
                      custom_params.get(REQUEST_KEYS["window"], self.window),
                      custom_params.get(REQUEST_KEYS["sink"], self.sink))


def release_span(prompt_len: int, protected_len: int, marker_at: int, policy: Policy
                 ) -> tuple[int, int]:
    """The row columns ``[lo, hi)`` that ``release-on-answer`` frees (may be empty: lo >= hi).

    | row columns                     | what                                   | fate     |
    |---------------------------------|----------------------------------------|----------|
    | ``[0, P)``                      | prompt (tree-owned below ``protected``) | kept     |
    | ``[P, P + S)``                  | thinking sink: first S thinking tokens | kept     |
    | ``[P + S, P + m - W)``          | thinking middle                        | freed    |
    | ``[P + m - W, P + m)``          | thinking window: last W thinking tokens| kept     |
    | ``[P + m, ...)``                | end marker, then the answer            | kept     |

    P = ``len(origin_input_ids)``; m = output index where the marker starts (every generated
    token before it is thinking); column ``P + j`` holds the KV of ``output_ids[j]``. ``lo``
    never goes below ``protected`` (KV the tree owns, e.g. a fork's shared prefix).
    """
    lo = max(prompt_len + policy.sink, protected_len)
    hi = prompt_len + marker_at - policy.window
    return lo, hi


def peak_output_kv(custom_params: dict | None, max_new_tokens: int, prompt_len: int,
                   protected_len: int, policy: Policy) -> int | None:
    """Most output-token KV a ``release-on-answer`` request holds at once, or None (unknown).

    Known when the request declares its shape the way budget forcing does
    (:class:`~sgl_reason.programs.budget.BudgetForcingProcessor`'s ``custom_params``: thinking
    ``budget``, marker ``end_ids`` of L tokens, ``max_answer``). With the marker at m <= budget:

    | phase                        | output KV held                                   |
    |------------------------------|--------------------------------------------------|
    | thinking, up to the release  | m + L + 1 (the step in flight) <= budget + L + 1 |
    | answering, after the release | min(m, S' + W) + L + a, with a <= max_answer     |

    S' = max(S, protected - P): a tree-owned prefix is never released. Stock admission
    reserves ``max_new_tokens`` (= budget + L + max_answer for a budgeted request); this bound
    is what the request can really hold, about half of that for equal thinking and answer.
    """
    params = custom_params or {}
    budget, end_ids, answer = (params.get(k) for k in ("budget", "end_ids", "max_answer"))
    if not (isinstance(budget, int) and isinstance(answer, int) and isinstance(end_ids, list)):
        return None
    if policy.name != "release-on-answer":
        return None
    marker = len(end_ids)
    kept = min(budget, max(policy.sink, protected_len - prompt_len) + policy.window)
    return min(max_new_tokens, max(budget + marker + 1, kept + marker + answer))


@dataclass
class ReqState:
    """What the backend tracks for one running request."""

    policy: Policy
    scanned: int = 0  # output_ids already searched for the marker
    marker_at: int | None = None  # output index where the end-of-thinking marker starts
    release_done: bool = False  # the current row has been through _release


def state(req) -> ReqState | None:
    return getattr(req, "_sgl_reason_kv", None)


# -- launch-time settings and validation ------------------------------------------------------

def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    if has_flag(parser, "--thinking-kv-policy"):
        return
    parser.add_argument(
        "--thinking-kv-policy", choices=POLICIES, default=None, action=export_to(ENV["policy"]),
        help="(sgl-reason) what happens to a reasoning request's thinking KV: keep (stock), "
             "strip (freed at finish, only the prompt is cached), demote (cached, evicted "
             "first) or release-on-answer (freed as soon as the answer starts, but the first "
             "--thinking-kv-sink and last --thinking-kv-window tokens). Implies "
             f"--radix-cache-backend {BACKEND}. Per request: custom_params "
             f"{{\"{REQUEST_KEYS['policy']}\": ...}}",
    )
    parser.add_argument(
        "--thinking-kv-window", type=int, default=None, action=export_to(ENV["window"]),
        help=f"(sgl-reason) thinking tokens kept before the end marker (default {DEFAULT_WINDOW})",
    )
    parser.add_argument(
        "--thinking-kv-sink", type=int, default=None, action=export_to(ENV["sink"]),
        help=f"(sgl-reason) first thinking tokens kept (default {DEFAULT_SINK})",
    )
    parser.add_argument(
        "--think-end", default=None, action=export_to(ENV["think_end"]),
        help="(sgl-reason) end-of-thinking marker text (default: the model profile's)",
    )


def think_end_for(model_path: str) -> tuple[str, str]:
    """(marker text, where it came from): the flag, else the model's profile."""
    text = os.environ.get(ENV["think_end"])
    if text is not None:
        return text, "--think-end"
    from sgl_reason.profiles import profile_for

    profile = profile_for(model_path)
    return profile.end_marker, f"the {profile.name!r} profile"


def release_supported(server_args) -> list[str]:
    """Why ``release-on-answer`` cannot run with these settings (empty: it can)."""
    from sgl_reason.runtime import cpu_attention

    problems = []
    if server_args.attention_backend != "torch_native" or not cpu_attention.enabled():
        problems.append("it needs the plugin's CPU attention (--attention-backend torch_native, "
                        f"{cpu_attention.ENV} not 0), the only one that skips released slots")
    if server_args.page_size not in (None, 1):
        problems.append("it needs --page-size 1")
    if server_args.speculative_algorithm:
        problems.append("speculative decoding is not supported")
    if server_args.enable_mixed_chunk:
        problems.append("--enable-mixed-chunk is not supported")
    return problems


def _requested(server_args) -> bool:
    return server_args.radix_cache_backend == BACKEND or any(
        os.environ.get(name) is not None for name in ENV.values())


def prepare(server_args) -> None:
    """Before SGLang resolves the arguments: the flags imply the backend (and, for demote,
    priority eviction)."""
    if not _requested(server_args):
        return
    backend = server_args.radix_cache_backend
    if backend not in (None, BACKEND):
        raise ValueError(f"--thinking-kv-* flags need --radix-cache-backend {BACKEND}, "
                         f"not {backend!r}. Drop --radix-cache-backend or set it to {BACKEND}.")
    server_args.radix_cache_backend = BACKEND
    policy = Policy.from_env()  # raises on an unknown policy, a negative window or sink
    if policy.name == "demote":
        if server_args.radix_eviction_policy not in ("lru", "priority"):
            raise ValueError("--thinking-kv-policy demote orders eviction by node priority; it "
                             f"cannot run with --radix-eviction-policy "
                             f"{server_args.radix_eviction_policy}. Drop that flag.")
        server_args.radix_eviction_policy = "priority"


def check_window(policy: Policy, context: int) -> None:
    if policy.window + policy.sink >= context:
        raise ValueError(f"--thinking-kv-window {policy.window} + --thinking-kv-sink "
                         f"{policy.sink} >= the context length {context}: no thinking could "
                         "ever be released. Use a smaller window.")


def _config_context(model_path: str) -> int | None:
    """The model's context length from its local ``config.json`` (None if not a local folder)."""
    import json
    from pathlib import Path

    config = Path(model_path) / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("max_position_embeddings")


def validate(server_args) -> None:
    """Launch-time checks (launcher process): every bad setting fails here, before serving."""
    if not _requested(server_args):
        return
    policy = Policy.from_env()
    marker, source = think_end_for(server_args.model_path)
    if not marker.strip():
        raise ValueError(f"No end-of-thinking marker: {source} gives {marker!r}. Pass "
                         "--think-end TEXT (the text the model writes when thinking ends).")
    if policy.name == "release-on-answer":
        problems = release_supported(server_args)
        if problems:
            raise ValueError("--thinking-kv-policy release-on-answer: " + "; ".join(problems)
                             + ". Supported elsewhere: keep, strip, demote.")
    context = server_args.context_length or _config_context(server_args.model_path)
    if context is not None:
        check_window(policy, context)


# -- the radix cache ---------------------------------------------------------------------------

class Metrics:
    """Prometheus series, written from the scheduler (rank 0) and served by SGLang's /metrics."""

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

    def update(self, thinking: int, answer: int, released: int = 0) -> None:
        if self.enabled:
            self.thinking.set(thinking)
            self.answer.set(answer)
            if released:
                self.released.inc(released)


def cache_class():
    """The radix cache subclass (built on first use: it derives from SGLang's UnifiedRadixCache)."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    class ThinkingKVCache(UnifiedRadixCache):
        """UnifiedRadixCache that applies the thinking-KV policies (module docstring)."""

        def setup(self, policy: Policy, marker_ids: list[int], metrics: Metrics,
                  release_ok: bool):
            self.policy, self.marker_ids, self.metrics = policy, marker_ids, metrics
            self.release_ok = release_ok
            self.held: dict[str, tuple[int, int]] = {}  # rid -> (thinking, answer) KV held
            # id(ReqKvInfo) -> (that ReqKvInfo, lo, hi): released columns of a live row. The
            # record is kept alive here, so its id cannot be reused while the entry exists.
            self.holes: dict[int, tuple[object, int, int]] = {}

        # -- requests come and go --------------------------------------------------------------
        def claim_kv_row(self, req) -> bool:
            st = state(req)
            if st is not None and req.finished() and st.policy.name == "strip":
                req.skip_radix_cache_insert = True  # the prompt is in the tree since prefill
            return super().claim_kv_row(req)

        def checkpoint_into_tree(self, req, *, up_to: int, **kwargs) -> None:
            st = state(req)
            if not (st is not None and st.policy.name == "demote" and req.finished()):
                return super().checkpoint_into_tree(req, up_to=up_to, **kwargs)
            # New nodes take the insert's priority, existing ones keep the max of theirs: the
            # prompt (inserted at prefill) keeps its own, what follows it is demoted.
            stock = req.priority
            req.priority = DEMOTED_PRIORITY
            try:
                super().checkpoint_into_tree(req, up_to=up_to, **kwargs)
            finally:
                req.priority = stock

        def free_kv_row(self, kv, ranges: list[tuple[int, int]]) -> None:
            """Free row ranges, minus a released hole of that row (already freed)."""
            hole = self.hole_of_kv(kv)
            if hole is not None:
                lo, hi = hole
                cut = []
                for start, end in ranges:
                    if start < lo:
                        cut.append((start, min(end, lo)))
                    if end > hi:
                        cut.append((max(start, hi), end))
                ranges = [(s, e) for s, e in cut if s < e]
            if ranges:
                super().free_kv_row(kv, ranges)

        def on_release(self, req, *, checkpointed: bool) -> None:
            super().on_release(req, checkpointed=checkpointed)
            self.holes.pop(id(req.kv), None)
            st = state(req)
            if st is not None:  # a retracted request comes back on a new, whole row
                st.release_done = False
            if self.held.pop(req.rid, None) is not None:
                self._publish()

        # -- after every decode step -------------------------------------------------------------
        def after_decode(self, reqs) -> int:
            """Find end markers, release thinking KV, update metrics. Returns slots freed."""
            released = 0
            for req in reqs:
                st = state(req)
                if st is None or req.finished() or not req.kv.holds_kv:
                    continue
                out = req.output_ids
                if st.marker_at is None:
                    st.marker_at = self._find_marker(out, st)
                if (st.marker_at is not None and st.policy.name == "release-on-answer"
                        and not st.release_done):
                    # once per row: a retracted request re-prefills a whole row, released anew
                    released += self._release(req, st)
                    st.release_done = True
                m = st.marker_at
                thinking = (len(out) if m is None else m) - self.released_slots(req.kv)
                self.held[req.rid] = (thinking, 0 if m is None else len(out) - m)
            self._publish(released)
            return released

        def _find_marker(self, out, st: ReqState) -> int | None:
            ids, n = self.marker_ids, len(self.marker_ids)
            start = max(0, st.scanned - n + 1)
            tail = list(out[start:])
            st.scanned = len(out)
            for i in range(len(tail) - n + 1):
                if tail[i:i + n] == ids:
                    return start + i
            return None

        def _release(self, req, st: ReqState) -> int:
            kv = req.kv
            lo, hi = release_span(len(req.origin_input_ids), kv.cache_protected_len,
                                  st.marker_at, st.policy)
            if hi <= lo:
                return 0
            row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
            if hi > kv.kv_committed_len or not bool((row[lo:hi] > 0).all()):
                # cannot happen by the range table; if it does, keeping the KV is always safe
                logger.error("sgl-reason: not releasing [%d, %d) of %s: committed %d",
                             lo, hi, req.rid, kv.kv_committed_len)
                return 0
            super().free_kv_row(kv, [(lo, hi)])
            row[lo:hi] = 0  # SGLang's padding slot: never allocated, never freed
            self.holes[id(kv)] = (kv, lo, hi)
            req.skip_radix_cache_insert = True  # the row is no longer a valid tree key
            return hi - lo

        def hole_of_kv(self, kv) -> tuple[int, int] | None:
            """Released columns of the row that ``kv`` (a ReqKvInfo) holds, if any."""
            entry = self.holes.get(id(kv))
            if entry is None or entry[0] is not kv:
                return None
            return entry[1], entry[2]

        def released_slots(self, kv) -> int:
            """Slots released from the row that ``kv`` holds (0 if none)."""
            hole = self.hole_of_kv(kv)
            return hole[1] - hole[0] if hole else 0

        def _publish(self, released: int = 0) -> None:
            thinking = sum(t for t, _ in self.held.values())
            answer = sum(a for _, a in self.held.values())
            self.metrics.update(thinking, answer, released)

    return ThinkingKVCache


# -- wiring into SGLang (plugin) ---------------------------------------------------------------

_CACHE = None  # the scheduler process's ThinkingKVCache, once built


def build_cache(ctx):
    """Radix cache factory for ``--radix-cache-backend sgl-reason`` (scheduler process)."""
    global _CACHE
    from sglang.srt.mem_cache.registry import create_unified_radix_cache
    from transformers import AutoTokenizer

    args = ctx.server_args
    policy = Policy.from_env()
    marker, source = think_end_for(args.model_path)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
    marker_ids = tokenizer.encode(marker, add_special_tokens=False)
    if not marker.strip() or not marker_ids:
        raise ValueError(f"No end-of-thinking marker: {source} gives {marker!r}. Pass "
                         "--think-end TEXT.")
    check_window(policy, ctx.model_config.context_len)
    cache = create_unified_radix_cache(ctx, cache_class=cache_class())
    cache.setup(policy, marker_ids, Metrics(bool(args.enable_metrics) and ctx.tp_rank == 0),
                release_ok=not release_supported(args))
    logger.info("sgl-reason thinking KV: policy %s, window %d, sink %d, marker %r = %s (%s)",
                policy.name, policy.window, policy.sink, marker, marker_ids, source)
    _CACHE = cache
    return cache


def _check_budget_params(req) -> bool:
    """Abort (a 400 with the reason) a budget-forcing request whose ``custom_params`` the
    processor could not run on; True when the request may go on."""
    params = getattr(req.sampling_params, "custom_params", None)
    if not (getattr(req, "custom_logit_processor", None) and isinstance(params, dict)
            and "budget" in params):
        return True
    from sgl_reason.programs.budget import budget_params_problem

    problem = budget_params_problem(params, getattr(req, "vocab_size", None))
    limit = getattr(req.sampling_params, "max_new_tokens", None)
    if problem is None and isinstance(limit, int):
        forced_end = params["budget"] + len(params["end_ids"])
        if params["budget"] < limit < forced_end:  # forcing would start and be cut mid-marker
            problem = (f"max_new_tokens ({limit}) ends inside the forced end-of-thinking marker "
                       f"(budget {params['budget']} + {len(params['end_ids'])} marker tokens): "
                       f"raise max_new_tokens to at least {forced_end + 1} or lower the budget")
    if problem is not None:
        req.set_finish_with_abort(f"custom_params: {problem}.")
    return problem is None


def _check_input(req) -> bool:
    """Abort (a 400) a request with no input token: SGLang 0.5.23's scheduler, given one alone,
    dies in the rotary embedding (a 0-token reshape) and takes the server with it."""
    if len(getattr(req, "origin_input_ids", None) or ()) > 0:
        return True
    req.set_finish_with_abort("the prompt is empty (0 tokens): send at least one token of "
                              "text or input_ids")
    return False


def _attach_state(req) -> None:
    """Give a new request its policy, or abort it with the reason (bad input, bad per-request
    override)."""
    if not (_check_input(req) and _check_budget_params(req)):
        return
    params = getattr(req.sampling_params, "custom_params", None)
    asks = bool(params) and any(k in params for k in REQUEST_KEYS.values())
    cache = _CACHE
    if cache is None:
        if asks:
            req.set_finish_with_abort(
                f"custom_params {sorted(k for k in REQUEST_KEYS.values() if k in params)} need "
                f"a server started with --radix-cache-backend {BACKEND} (or "
                "--thinking-kv-policy).")
        return
    try:
        policy = cache.policy.override(params)
    except ValueError as error:
        req.set_finish_with_abort(str(error))
        return
    if policy.name == "release-on-answer" and not cache.release_ok:
        req.set_finish_with_abort("release-on-answer is not available on this server: "
                                  "it needs the sgl-reason CPU attention and --page-size 1.")
        return
    req._sgl_reason_kv = ReqState(policy)


def tokens_to_come(req) -> int | None:
    """Most KV slots a request may still allocate, release-aware (None: no better bound than
    SGLang's own ``max_new_tokens - len(output_ids)``). Feeds :func:`_install_admission`."""
    cache, st = _CACHE, state(req)
    if cache is None or st is None or not cache.release_ok:
        return None
    if getattr(req, "custom_logit_processor", None) is None:
        return None  # a declared shape is only trusted with a processor there to enforce it
    kv = req.kv
    protected = max(kv.cache_protected_len or 0, req.prefix_len or 0)
    peak = peak_output_kv(req.sampling_params.custom_params, req.sampling_params.max_new_tokens,
                          len(req.origin_input_ids), protected, st.policy)
    if peak is None:
        return None
    return max(0, peak - (len(req.output_ids) - cache.released_slots(kv)))


def holes_for(reqs) -> list[tuple[int, int] | None] | None:
    """Per request of a batch, its released columns; None when no request has any."""
    cache = _CACHE
    if cache is None or not cache.holes:
        return None
    holes = [cache.hole_of_kv(req.kv) for req in reqs]
    return holes if any(h is not None for h in holes) else None


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

    wrap_server_args("thinking_kv", add_cli_flags, validate, prepare)
    if get_radix_cache_factory(BACKEND) is None:
        register_radix_cache_backend(BACKEND, build_cache)

    req_cls = schedule_batch.Req
    if getattr(req_cls, "_sgl_reason_kv_hooks", False):
        return
    stock_req_init = req_cls.__init__

    def req_init(self, *args, **kwargs):
        stock_req_init(self, *args, **kwargs)
        _attach_state(self)

    req_cls.__init__ = req_init

    scheduler_cls = scheduler.Scheduler
    stock_process = scheduler_cls.process_batch_result

    def process_batch_result(self, batch, result, *args, **kwargs):
        out = stock_process(self, batch, result, *args, **kwargs)
        cache = _CACHE
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
        forward_batch.sgl_reason_holes = holes_for(batch.reqs)
        return forward_batch

    ForwardBatch.init_new = classmethod(init_new)

    _install_admission()

    # SGLang's pool accounting (busy-time leak check, /v1/loads, metrics) counts a request's
    # private KV as its row past the protected prefix; a released hole is not held any more.
    stock_private = pool_stats_observer.kv_private_tokens

    def kv_private_tokens(kv, page_size):
        tokens = stock_private(kv, page_size)
        return tokens - _CACHE.released_slots(kv) if _CACHE is not None else tokens

    for module in (pool_stats_observer, invariant_checker):
        if getattr(module, "kv_private_tokens", None) is stock_private:
            module.kv_private_tokens = kv_private_tokens
    req_cls._sgl_reason_kv_hooks = True


def _install_admission() -> None:
    """Admission that knows a budgeted release-on-answer request's real peak.

    SGLang's PrefillAdder charges a new request ``max_new_tokens`` and each running one its
    remaining ``max_new_tokens - len(output_ids)`` (times ``new_token_ratio``). Both are
    replaced by :func:`tokens_to_come` where that is smaller; everything else (ratio, retraction
    when decode runs out) stays SGLang's.
    """
    from sglang.srt.managers import schedule_policy

    adder = schedule_policy.PrefillAdder
    stock_offset = adder._get_running_request_total_token_offset
    stock_add = adder.add_one_req

    def stock_left(req) -> int:
        left = req.sampling_params.max_new_tokens - len(req.output_ids)
        return min(max(left, 0), schedule_policy.CLIP_MAX_NEW_TOKENS)

    def running_offset(self, req):
        offset = stock_offset(self, req)
        bound, left = tokens_to_come(req), stock_left(req)
        if bound is None or bound >= left:
            return offset
        return offset * bound / left  # the same new_token_ratio, on the smaller count

    def add_one_req(self, req, *args, **kwargs):
        bound, left = tokens_to_come(req), stock_left(req)
        credit = 0 if bound is None else max(0, left - bound)
        if not credit:
            return stock_add(self, req, *args, **kwargs)
        # The stock code charges `left` for the request's decode; credit the difference, and
        # keep it only if the request was admitted whole (a chunk is charged no decode).
        budget = self.memory_budget
        budget.total_offset -= credit
        try:
            result = stock_add(self, req, *args, **kwargs)
        except BaseException:
            budget.total_offset += credit
            raise
        if req not in self.can_run_list or self.new_chunked_req is req:
            budget.total_offset += credit
        return result

    adder._get_running_request_total_token_offset = running_offset
    adder.add_one_req = add_one_req
