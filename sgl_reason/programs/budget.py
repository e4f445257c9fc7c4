"""Thinking budgets: the config, and the server-side logit processor that enforces one.

:class:`BudgetForcingProcessor` runs inside the SGLang scheduler (sent by reference with
``dill``, so the server needs sgl-reason installed, as it does for the plugin; start it with
``--enable-custom-logit-processor``). Per request it follows a small state machine kept in the
request's own ``custom_params`` dict, which lives as long as the request:

| phase     | tokens generated ``t``            | what the processor does                         |
|-----------|-----------------------------------|-------------------------------------------------|
| thinking  | ``t < budget``, no marker yet     | masks EOS (thinking ends only by the marker)    |
| forcing   | ``budget <= t < budget + len(end)``| forces ``end_ids[t - budget]``: the marker      |
| answering | marker seen (own or forced)       | EOS masked before the optional ``min_answer``-th token; the ``max_answer``-th is forced EOS |

``t`` is the request's committed KV length less its prompt (:func:`_tokens_before`), not
``len(req.output_ids)``, which lags by a step under SGLang's overlap scheduler, nor a count of
calls, which a retraction would put one ahead. The model's own marker
is detected in ``output_ids`` (possibly one step late, which only shifts the answer limit) as
``marker_ids`` (default ``end_ids``): the profile's single end token where the model has one, so
that it is found whatever text the tokenizer merged next to it. Detection scans every token
since the previous call, not just the last one: when a prefill batch runs between two decode
steps, the overlap scheduler processes both steps' results before the next sampling, so a call
sees two new tokens, and a marker in the first of them would otherwise go unseen (the model
then answers with EOS masked: v6 ran on past its answer in 8 of 1,350 evaluated samples).
Hard bound: at most ``budget`` tokens precede the first marker.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sgl_reason.tokens import find_new_tokens

TIERS: dict[str, int] = {"low": 4096, "medium": 16384, "high": 65536}
# The server's thinking-KV policies (runtime/thinking_kv.py POLICIES; a test keeps them equal)
# and the custom_params key that sets one per request.
KV_POLICIES = ("keep", "strip", "demote", "release-on-answer", "release-on-pressure")
KV_POLICY_KEY = "thinking_kv_policy"
# custom_params key of an answer request whose prompt holds its thinking: where it starts
THINKING_START = "thinking_start"


class KVPolicy(BaseModel):
    """One call's thinking-KV rule, beyond the policy name: what a releasing policy keeps.

    ``keep``: scored retention, a fraction of the thinking (float in [0, 1]) or a token count
    (int) kept besides the first ``sink`` and last ``window`` thinking tokens; the kept tokens
    are those the end of thinking attended to most (``score``: mean or max over heads and
    layers). None fields leave the server's settings."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Literal[KV_POLICIES]  # type: ignore[valid-type]
    keep: float | int | None = None
    window: int | None = Field(default=None, ge=0)
    sink: int | None = Field(default=None, ge=0)
    score: Literal["mean", "max"] | None = None

    @model_validator(mode="after")
    def _keep_in_range(self):
        if isinstance(self.keep, float) and not 0.0 <= self.keep <= 1.0:
            raise ValueError(f"keep as a fraction must be in [0, 1], got {self.keep}")
        if isinstance(self.keep, int) and self.keep < 0:
            raise ValueError(f"keep as a token count must be >= 0, got {self.keep}")
        return self

    def params(self) -> dict:
        """The request's ``custom_params`` keys (the server's per-request override)."""
        out = {KV_POLICY_KEY: self.name}
        for field in ("keep", "window", "sink", "score"):
            value = getattr(self, field)
            if value is not None:
                out[f"thinking_kv_{field}"] = value
        return out


class ThinkingBudget(BaseModel):
    """How long a program may think and answer."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_thinking_tokens: int | Literal["low", "medium", "high"] = "low"
    max_answer_tokens: int = Field(512, ge=1)
    # Thinking that closes earlier is reopened with the profile's wait_text (s1's "Wait").
    min_thinking_tokens: int = Field(0, ge=0)
    # "auto": one request with server-side forcing when the server allows custom logit
    # processors, else two requests; "single"/"two" force one route ("single" fails if the
    # server cannot). min_thinking_tokens > 0 always uses the multi-request route.
    mode: Literal["auto", "single", "two"] = "auto"

    @property
    def thinking_tokens(self) -> int:
        value = self.max_thinking_tokens
        return TIERS[value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> ThinkingBudget:
        if self.thinking_tokens < 1:
            raise ValueError(
                f"max_thinking_tokens must be >= 1 or one of {sorted(TIERS)}, "
                f"got {self.max_thinking_tokens!r}"
            )
        if self.min_thinking_tokens > self.thinking_tokens:
            raise ValueError(
                f"min_thinking_tokens ({self.min_thinking_tokens}) exceeds max_thinking_tokens "
                f"({self.thinking_tokens}): lower the minimum or raise the budget."
            )
        return self


def as_budget(budget: ThinkingBudget | int | str | None) -> ThinkingBudget:
    """A budget from a :class:`ThinkingBudget`, a thinking-token count or a tier name."""
    if budget is None:
        return ThinkingBudget()
    if isinstance(budget, ThinkingBudget):
        return budget
    if isinstance(budget, (int, str)) and not isinstance(budget, bool):
        return ThinkingBudget(max_thinking_tokens=budget)
    raise TypeError(f"budget must be a ThinkingBudget, a token count or one of {sorted(TIERS)}, "
                    f"got {type(budget).__name__}")


def check_kv_policy(policy: str | KVPolicy | None) -> str | KVPolicy | None:
    if isinstance(policy, KVPolicy):
        return policy
    if policy is not None and policy not in KV_POLICIES:
        raise ValueError(f"Unknown thinking-KV policy {policy!r}: use one of "
                         f"{', '.join(KV_POLICIES)}, a KVPolicy (to set what release keeps), "
                         "or None for the server's default.")
    return policy


def kv_params(policy: str | KVPolicy | None) -> dict:
    """``custom_params`` keys that set a request's thinking-KV rule (empty: the server's)."""
    if policy is None:
        return {}
    return policy.params() if isinstance(policy, KVPolicy) else {KV_POLICY_KEY: policy}


def budget_params_problem(params: dict, vocab_size: int | None = None) -> str | None:
    """What is wrong with a request's :class:`BudgetForcingProcessor` ``custom_params``, in one
    sentence that names the fix, or None. The server's plugin aborts such a request with this
    reason (a 400, ``runtime/thinking_kv.py``); the processor also checks once per request and
    leaves a bad row alone, because the abort lands after one sampling step has run."""
    def is_int(v, low=0):
        return isinstance(v, int) and not isinstance(v, bool) and v >= low

    def is_ids(v):
        return (isinstance(v, list) and v and all(is_int(i) for i in v)
                and (vocab_size is None or all(i < vocab_size for i in v)))

    ids_rule = "a non-empty list of token ids" + (f" below {vocab_size}" if vocab_size else "")
    if not is_int(params.get("budget")):
        return f"budget must be an integer >= 0, got {params.get('budget')!r}"
    for key in ("end_ids", "marker_ids", "eos_ids"):
        if (key == "end_ids" or params.get(key) is not None) and not is_ids(params.get(key)):
            return f"{key} must be {ids_rule}, got {params.get(key)!r}"
    if not is_int(params.get("max_answer"), low=1):
        return f"max_answer must be an integer >= 1, got {params.get('max_answer')!r}"
    if "min_answer" in params and not (is_int(params["min_answer"])
                                       and params["min_answer"] <= params["max_answer"]):
        return (f"min_answer must be an integer between 0 and max_answer "
                f"({params['max_answer']}), got {params['min_answer']!r}")
    return None


def _base():
    from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

    return CustomLogitProcessor


def _stop_ids(req) -> set[int]:
    """Every token id that would finish ``req``, as ``Req._check_token_based_finish`` sees it."""
    if req is None:
        return set()
    ids = set(getattr(req, "eos_token_ids", None) or ())
    ids |= set(getattr(req.sampling_params, "stop_token_ids", None) or ())
    tokenizer = getattr(req, "tokenizer", None)
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        ids |= set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
    return ids


def _tokens_before(req, counted: int) -> int:
    """Output tokens before the one being sampled now.

    The request's committed KV length is its prompt plus exactly those tokens, both after a
    decode step's slot allocation and after a prefill, a retracted request's re-prefill
    included; the processor's own call count runs one ahead for every token a retraction
    discarded. The count is the fallback where no request is attached."""
    kv = getattr(req, "kv", None)
    if kv is None or not getattr(kv, "kv_committed_len", 0):
        return counted
    return kv.kv_committed_len - len(req.origin_input_ids)


def _marker_end(out, marker: list[int], p: dict[str, Any]) -> int | None:
    """The output position just after the first ``marker`` in ``out``, or None. Scans only what
    earlier calls have not (``p["_scanned"]``): a call may see two new tokens at once (see the
    module docstring), so the marker is not always the last one."""
    at, p["_scanned"] = find_new_tokens(out, marker, p.get("_scanned", 0))
    return None if at < 0 else at + len(marker)


class BudgetForcingProcessor(_base()):
    """Custom params per request: ``budget``, ``end_ids``, ``max_answer``, optional
    ``marker_ids`` (what detection matches, default ``end_ids``), ``eos_ids`` and
    ``min_answer`` (with ``min_answer == max_answer`` the answer has exactly that many
    tokens, its EOS included: fixed-shape benchmarks)."""

    def __call__(self, logits, custom_param_list: list[dict[str, Any]] | None = None):
        for row, params in enumerate(custom_param_list or []):
            if not (isinstance(params, dict) and "budget" in params):
                continue
            if "_ok" not in params:  # checked once; a bad request is left alone (the server's
                # plugin aborts it with the reason) instead of raising in the sampling step
                params["_ok"] = budget_params_problem(params, logits.shape[-1]) is None
            if params["_ok"]:
                self._step(logits, row, params)
        return logits

    @staticmethod
    def _force(logits, row: int, token_id: int) -> None:
        logits[row, :] = -float("inf")
        logits[row, token_id] = 0.0

    def _step(self, logits, row: int, p: dict[str, Any]) -> None:
        req = p.get("__req__")
        t = _tokens_before(req, p.get("_t", 0))
        p["_t"] = t + 1
        end: list[int] = p["end_ids"]
        if "_eos" not in p:
            p["_eos"] = sorted(set(p.get("eos_ids") or ()) | _stop_ids(req))
        eos = p["_eos"]
        closed_at = p.get("_closed_at")
        if closed_at is None and req is not None:
            closed_at = p["_closed_at"] = _marker_end(req.output_ids, p.get("marker_ids") or end, p)
        if closed_at is None:
            j = t - p["budget"]
            if j >= 0:
                self._force(logits, row, end[j])
                if j == len(end) - 1:
                    p["_closed_at"] = t + 1
            elif eos:
                logits[row, eos] = -float("inf")
        elif t - closed_at >= p["max_answer"] - 1 and eos:
            self._force(logits, row, eos[0])  # the EOS is the last of max_answer tokens
        elif t - closed_at < p.get("min_answer", 0) - 1 and eos:
            logits[row, eos] = -float("inf")
