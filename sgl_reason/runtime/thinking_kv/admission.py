"""Admission: each new request gets its policy (or a 400 that says why), and a releasing
request that declares its shape is charged its real peak KV, not its ``max_new_tokens``.

SGLang's ``PrefillAdder`` charges a new request ``max_new_tokens`` and each running one its
remaining ``max_new_tokens - len(output_ids)`` times ``new_token_ratio`` (an estimate of early
EOS). For a budgeted request on a releasing policy, :func:`tokens_to_come` is an exact bound
(:func:`~sgl_reason.runtime.thinking_kv.policy.peak_output_kv`), so it replaces both, with no
ratio applied on top. The credit is given only when the request's declared end marker is the
server's (the one release looks for) and a budget-forcing processor is there to enforce the
shape; everything else (retraction when decode runs out) stays SGLang's.
"""

from __future__ import annotations

from sgl_reason.runtime.thinking_kv import cache as cache_mod
from sgl_reason.runtime.thinking_kv.launch import BACKEND
from sgl_reason.runtime.thinking_kv.policy import (
    REQUEST_KEYS,
    THINKING_START,
    ReqState,
    peak_output_kv,
    state,
)
from sgl_reason.runtime.thinking_kv.scoring import ScoreBook


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


def attach_state(req) -> None:
    """Give a new request its policy, or abort it with the reason (bad input, bad per-request
    override, a policy this server cannot apply)."""
    if not (_check_input(req) and _check_budget_params(req)):
        return
    params = getattr(req.sampling_params, "custom_params", None)
    asks = bool(params) and any(k in params for k in REQUEST_KEYS.values())
    cache = cache_mod.current()
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
    if policy.releases and not cache.release_ok:
        req.set_finish_with_abort(
            f"{policy.name} is not available on this server: "
            + "; ".join(cache.release_problems) + ".")
        return
    if policy.name == "demote" and not cache.demote_ok:
        req.set_finish_with_abort(
            "demote orders eviction by node priority, and this server evicts by "
            "another order: start it with --thinking-kv-policy demote (or "
            "--radix-eviction-policy priority), or ask for keep, strip or release-on-answer.")
        return
    st = ReqState(policy, think_from=len(req.origin_input_ids))
    if not _declare_thinking(req, st, params, cache.marker_ids):
        return
    if policy.scored:
        st.book = ScoreBook(policy.observe, policy.score)
    req._sgl_reason_kv = st


def _declare_thinking(req, st: ReqState, params: dict | None, marker_ids: list[int]) -> bool:
    """A request whose prompt already holds thinking (``custom_params.thinking_start``, the
    position where it starts): the thinking runs to the first of the server's end markers
    after that position. Aborts (a 400 that names the fix) when there is none."""
    start = (params or {}).get(THINKING_START)
    if start is None:
        return True
    ids = req.origin_input_ids
    if not (isinstance(start, int) and not isinstance(start, bool) and 0 <= start < len(ids)):
        req.set_finish_with_abort(
            f"custom_params.{THINKING_START} is the input position where the thinking starts: "
            f"an integer in [0, {len(ids)}) for this prompt, got {start!r}.")
        return False
    n = len(marker_ids)
    at = next((i for i in range(start, len(ids) - n + 1) if list(ids[i:i + n]) == marker_ids),
              None)
    if at is None:
        req.set_finish_with_abort(
            f"custom_params.{THINKING_START}={start}, but the prompt has no end-of-thinking "
            f"marker (token ids {marker_ids}) after it: append the marker after the thinking, "
            f"or drop {THINKING_START}.")
        return False
    st.think_from, st.marker_col, st.declared = start, at, True
    return True


def tokens_to_come(req) -> int | None:
    """Most KV slots a request may still allocate, release-aware (None: no better bound than
    SGLang's own ``max_new_tokens - len(output_ids)``)."""
    cache, st = cache_mod.current(), state(req)
    if cache is None or st is None or not cache.release_ok:
        return None
    if getattr(req, "custom_logit_processor", None) is None:
        return None  # a declared shape is only trusted with a processor there to enforce it
    params = req.sampling_params.custom_params or {}
    if list(params.get("end_ids") or ()) != list(cache.marker_ids):
        return None  # release looks for the server's marker: another one would never release
    kv = req.kv
    protected = max(kv.cache_protected_len or 0, req.prefix_len or 0)
    peak = peak_output_kv(params, req.sampling_params.max_new_tokens,
                          len(req.origin_input_ids), protected, st.policy)
    if peak is None:
        return None
    return max(0, peak - (len(req.output_ids) - cache.released_slots(kv)))


def install_admission() -> None:
    """Patch ``PrefillAdder`` so a releasing request is charged :func:`tokens_to_come`."""
    from sglang.srt.managers import schedule_policy

    adder = schedule_policy.PrefillAdder
    if getattr(adder, "_sgl_reason_admission", False):
        return
    stock_offset = adder._get_running_request_total_token_offset
    stock_add = adder.add_one_req

    def stock_left(req) -> int:
        left = req.sampling_params.max_new_tokens - len(req.output_ids)
        return min(max(left, 0), schedule_policy.CLIP_MAX_NEW_TOKENS)

    def running_offset(self, req):
        offset = stock_offset(self, req)
        bound = tokens_to_come(req)
        if bound is None or bound >= offset:
            return offset
        return bound  # exact: no early-EOS ratio on top

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
    adder._sgl_reason_admission = True
