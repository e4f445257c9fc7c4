"""What a request asks of its thinking KV, and which columns of its row that frees.

A :class:`Policy` is set per server (flags, exported to the environment) and may be overridden
per request (``sampling_params.custom_params``). Pure arithmetic: nothing here touches a pool.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

POLICIES = ("keep", "strip", "demote", "release-on-answer", "release-on-pressure")
RELEASING = ("release-on-answer", "release-on-pressure")  # free thinking KV while running
SCORE_REDUCTIONS = ("mean", "max")
DEFAULT_WINDOW = 16
DEFAULT_SINK = 4
DEFAULT_OBSERVE = 32
ENV = {
    "policy": "SGL_REASON_THINKING_KV_POLICY",
    "window": "SGL_REASON_THINKING_KV_WINDOW",
    "sink": "SGL_REASON_THINKING_KV_SINK",
    "keep": "SGL_REASON_THINKING_KV_KEEP",
    "score": "SGL_REASON_THINKING_KV_SCORE",
    "observe": "SGL_REASON_THINKING_KV_OBSERVE",
    "think_end": "SGL_REASON_THINK_END",
}
# custom_params keys of the per-request override
REQUEST_KEYS = {"policy": "thinking_kv_policy", "window": "thinking_kv_window",
                "sink": "thinking_kv_sink", "keep": "thinking_kv_keep",
                "score": "thinking_kv_score", "observe": "thinking_kv_observe"}
# custom_params key of a request whose prompt already holds thinking and the end marker (the
# answer request of the two-request and chunked routes): the input position where the
# thinking starts. The server finds its own marker after it and releases that span.
THINKING_START = "thinking_start"


def parse_keep(text: str | None) -> float | int | None:
    """``--thinking-kv-keep``: ``0.1`` or ``10%`` (a fraction of the thinking), ``64`` (tokens),
    empty or ``none`` (no scored retention: sink and window only)."""
    if text is None or text.strip().lower() in ("", "none"):
        return None
    t = text.strip()
    try:
        if t.endswith("%"):
            return float(t[:-1]) / 100
        return float(t) if any(c in t for c in ".eE") else int(t)
    except ValueError:
        raise ValueError(f"--thinking-kv-keep takes a fraction (0.1 or 10%) or a token count "
                         f"(64), got {text!r}") from None


@dataclass(frozen=True)
class Policy:
    name: str = "keep"
    window: int = DEFAULT_WINDOW  # last thinking tokens kept
    sink: int = DEFAULT_SINK  # first thinking tokens kept
    keep: float | int | None = None  # scored retention: fraction of the thinking, or tokens
    score: str = "mean"  # how one token's attention is aggregated over heads and layers
    observe: int = DEFAULT_OBSERVE  # decode steps whose attention is summed into the scores

    def __post_init__(self):
        if self.name not in POLICIES:
            raise ValueError(f"Unknown thinking-KV policy {self.name!r}. Supported: "
                             f"{', '.join(POLICIES)}.")
        for what, value in (("window", self.window), ("sink", self.sink)):
            if not _is_int(value) or value < 0:
                raise ValueError(f"thinking-KV {what} must be an integer >= 0, got {value!r}.")
        if self.keep is not None and not (
                (_is_int(self.keep) and self.keep >= 0)
                or (isinstance(self.keep, float) and 0.0 <= self.keep <= 1.0)):
            raise ValueError(f"thinking-KV keep must be a fraction in [0, 1] (a float) or a "
                             f"token count >= 0 (an integer), got {self.keep!r}.")
        if self.score not in SCORE_REDUCTIONS:
            raise ValueError(f"thinking-KV score must be one of {', '.join(SCORE_REDUCTIONS)}, "
                             f"got {self.score!r}.")
        if not _is_int(self.observe) or self.observe < 1:
            raise ValueError(f"thinking-KV observe must be an integer >= 1, got "
                             f"{self.observe!r}.")

    @property
    def releases(self) -> bool:
        return self.name in RELEASING

    @property
    def scored(self) -> bool:
        """Whether release needs scores: scored retention keeps the best-scored tokens, and
        release under pressure frees the lowest-scored first."""
        return self.name == "release-on-pressure" or (self.releases and self.keep is not None)

    @classmethod
    def from_env(cls) -> Policy:
        env = os.environ.get
        return cls(env(ENV["policy"], "keep"),
                   int(env(ENV["window"], DEFAULT_WINDOW)),
                   int(env(ENV["sink"], DEFAULT_SINK)),
                   parse_keep(env(ENV["keep"])),
                   env(ENV["score"], "mean"),
                   int(env(ENV["observe"], DEFAULT_OBSERVE)))

    def override(self, custom_params: dict | None) -> Policy:
        """This policy with a request's ``custom_params`` keys applied (ValueError if bad)."""
        if not custom_params or not any(k in custom_params for k in REQUEST_KEYS.values()):
            return self
        values = {field: custom_params.get(key, getattr(self, "name" if field == "policy"
                                                         else field))
                  for field, key in REQUEST_KEYS.items()}
        return Policy(values.pop("policy"), **values)

    def keep_count(self, thinking: int) -> int:
        """Scored thinking tokens kept besides the sink and the window (0 without scoring)."""
        if self.keep is None:
            return 0
        if isinstance(self.keep, float):
            return math.ceil(self.keep * thinking)
        return self.keep


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def release_span(prompt_len: int, protected_len: int, marker_at: int, policy: Policy
                 ) -> tuple[int, int]:
    """The row columns ``[lo, hi)`` that release may free (may be empty: lo >= hi).

    | row columns                     | what                                   | fate     |
    |---------------------------------|----------------------------------------|----------|
    | ``[0, P)``                      | prompt (tree-owned below ``protected``) | kept     |
    | ``[P, P + S)``                  | thinking sink: first S thinking tokens | kept     |
    | ``[P + S, P + m - W)``          | thinking middle                        | freed, but the best-scored K (scored retention) |
    | ``[P + m - W, P + m)``          | thinking window: last W thinking tokens| kept     |
    | ``[P + m, ...)``                | end marker, then the answer            | kept     |

    P = ``len(origin_input_ids)``; m = output index where the marker starts (every generated
    token before it is thinking); column ``P + j`` holds the KV of ``output_ids[j]``. ``lo``
    never goes below ``protected`` (KV the tree owns, e.g. a fork's shared prefix).
    """
    lo = max(prompt_len + policy.sink, protected_len)
    hi = prompt_len + marker_at - policy.window
    return lo, hi


def columns_to_free(prompt_len: int, protected_len: int, marker_at: int, policy: Policy,
                    scores: torch.Tensor | None) -> torch.Tensor:
    """Sorted row columns (int64) that release frees: the middle of :func:`release_span`, less
    its ``policy.keep_count(m)`` best-scored columns.

    ``scores[c]`` is column c's accumulated attention (``scoring.ScoreBook``); ties keep the
    later column. Without scores (the request decoded no observed step, e.g. a marker that
    came in a prompt), the latest K columns of the middle are kept: a wider window.
    """
    lo, hi = release_span(prompt_len, protected_len, marker_at, policy)
    if hi <= lo:
        return torch.empty(0, dtype=torch.int64)
    middle = torch.arange(lo, hi, dtype=torch.int64)
    k = min(policy.keep_count(marker_at), hi - lo)
    if k == 0:
        return middle
    if scores is None or scores.numel() == 0:
        return middle[:hi - lo - k]
    s = torch.zeros(hi - lo, dtype=torch.float64)
    have = min(hi, scores.numel()) - lo
    if have > 0:
        s[:have] = scores[lo:lo + have].double()
    # a tiny ramp breaks ties toward later columns, deterministically
    s = s + torch.arange(hi - lo, dtype=torch.float64) * 1e-12
    kept = torch.topk(s, k).indices
    free = torch.ones(hi - lo, dtype=torch.bool)
    free[kept] = False
    return middle[free]


def peak_output_kv(custom_params: dict | None, max_new_tokens: int, prompt_len: int,
                   protected_len: int, policy: Policy) -> int | None:
    """Most output-token KV a releasing request holds at once, or None (unknown).

    Known when the request declares its shape the way budget forcing does
    (:class:`~sgl_reason.programs.budget.BudgetForcingProcessor`'s ``custom_params``: thinking
    ``budget``, marker ``end_ids`` of L tokens, ``max_answer``). With the marker at m <= budget:

    | phase                        | output KV held                                   |
    |------------------------------|--------------------------------------------------|
    | thinking, up to the release  | m + L + 2 (the marker's step, then the step in flight) <= budget + L + 2 |
    | answering, after the release | min(m, S' + W + K) + L + a, with a <= max_answer |

    S' = max(S, protected - P): a tree-owned prefix is never released; K = the scored tokens
    kept (``keep_count(budget)``, the most for any m <= budget). Stock admission reserves
    ``max_new_tokens`` (= budget + L + max_answer for a budgeted request); this bound is what
    the request can really hold, about half of that for equal thinking and answer.
    """
    params = custom_params or {}
    budget, end_ids, answer = (params.get(k) for k in ("budget", "end_ids", "max_answer"))
    if not (isinstance(budget, int) and isinstance(answer, int) and isinstance(end_ids, list)):
        return None
    if not policy.releases:
        return None
    marker = len(end_ids)
    kept = min(budget, max(policy.sink, protected_len - prompt_len) + policy.window
               + policy.keep_count(budget))
    # a scored release waits one step after the marker (its query is observed)
    thinking_peak = budget + marker + (2 if policy.scored else 1)
    return min(max_new_tokens, max(thinking_peak, kept + marker + answer))


@dataclass
class ReqState:
    """What the backend tracks for one running request. Positions are row columns (= token
    positions): thinking is ``[think_from, marker_col)``, the marker starts at ``marker_col``.
    Generated route: ``think_from`` is the prompt length and the marker is found in the output.
    Declared route (:data:`THINKING_START`): both lie inside the prompt, known at admission."""

    policy: Policy
    think_from: int  # first thinking column
    declared: bool = False  # thinking and marker came in the prompt
    scanned: int = 0  # output_ids already searched for the marker
    marker_col: int | None = None  # row column where the end-of-thinking marker starts
    release_done: bool = False  # the current row has been through release (or, under
    # pressure, its releasable columns are decided)
    book: object | None = None  # scoring.ScoreBook while a scored request thinks
    observed: int = 0  # query steps behind the scores of the last release decision
    pending: torch.Tensor | None = None  # release-on-pressure: columns not yet freed, lowest
    pending_scores: torch.Tensor | None = None  # score first, and their scores

    def observed_rows(self, marker_len: int) -> tuple[int, int] | None:
        """The query positions scored retention observes, ``[lo, hi)``: the last ``observe``
        thinking tokens and the marker (None until the marker is known). A decode step's
        query is the token at its position, so decoding observes exactly these rows; a prefill
        (declared route, or a retracted request's re-prefill) observes them inside its extend."""
        if self.marker_col is None:
            return None
        hi = self.marker_col + marker_len
        return max(self.think_from, hi - self.policy.observe), hi


def state(req) -> ReqState | None:
    return getattr(req, "_sgl_reason_kv", None)
