"""The early-stop config, the signal interface and its registry."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SIGNALS: dict[str, type["Signal"]] = {}

# Defaults per signal for ``EarlyStop.threshold``.
DEFAULT_THRESHOLDS = {"entropy": 0.1, "confidence": 0.5}


class EarlyStop(BaseModel):
    """Which signal stops what, and its knobs. Validated against the registry and ranges."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    signal: str
    chunk_tokens: int = Field(32, ge=1)  # thinking is generated and checked every K tokens
    window: int = Field(32, ge=1)  # entropy: tokens averaged; confidence: group size
    threshold: float | None = None  # entropy (nats, >= 0) or confidence (> 0); signal default
    top_k: int = Field(5, ge=2, le=20)  # top logprobs per token, for entropy and confidence
    probe_tokens: int = Field(16, ge=1)  # probe: tokens a probe may generate
    probe_stop: tuple[str, ...] = ("\n",)  # probe: the answer is read up to these strings
    probe_agree: int = Field(2, ge=1)  # probe: consecutive equal probe answers needed
    # probe: probe only after a chunk whose text (with the end of the one before) contains one
    # of these strings, the model's own transition words (DEER); empty: after every chunk
    probe_cues: tuple[str, ...] = ()
    # probe: a probe's answer counts only if its tokens' geometric-mean probability is >= this
    probe_confidence: float = Field(0.0, ge=0.0, lt=1.0)
    answer_from_probe: bool = True  # probe: the settled probe is the answer (no answer request)
    batch: int = Field(4, ge=2)  # consensus: samples per window
    confidence_level: float = Field(0.95, gt=0.5, lt=1.0)  # consensus: Beta posterior mass
    min_tokens: int = Field(0, ge=0)  # never stop before this many thinking tokens
    # confidence in self_consistency (DeepConf online): the first ``warmup`` traces are drawn
    # whole, and the threshold becomes the confidence that keeps their top ``keep_top``
    # fraction (DeepConf-low: 0.1, DeepConf-high: 0.9); 0: the fixed ``threshold``
    warmup: int = Field(0, ge=0)
    keep_top: float = Field(0.9, gt=0.0, le=1.0)

    @field_validator("signal")
    @classmethod
    def _known(cls, name: str) -> str:
        get_signal(name)  # raises, listing the registered signals
        return name

    @field_validator("probe_cues", mode="before")
    @classmethod
    def _cue_list(cls, cues):
        """``"Check,Wait"`` (a command-line option) is the cues ``("Check", "Wait")``."""
        return tuple(c.strip() for c in cues.split(",")) if isinstance(cues, str) else cues

    @model_validator(mode="after")
    def _ranges(self) -> "EarlyStop":
        t = self.threshold
        if t is not None and (not math.isfinite(t) or t < 0 or (self.signal == "confidence" and t == 0)):
            raise ValueError(f"threshold {t} is out of range for {self.signal!r}: use a finite "
                             "value >= 0 (entropy, in nats) or > 0 (confidence)")
        if self.probe_agree == 1 and self.probe_confidence == 0 and self.signal == "probe":
            raise ValueError("probe_agree=1 stops at the first probe that states any answer: "
                             "set probe_confidence > 0 (stop on one confident probe, as DEER "
                             "does) or probe_agree >= 2")
        if any(not cue for cue in self.probe_cues):
            raise ValueError("probe_cues must be non-empty strings (the model's transition "
                             "words, e.g. 'Wait'), or () to probe after every chunk")
        return self

    @property
    def effective_threshold(self) -> float | None:
        return self.threshold if self.threshold is not None else DEFAULT_THRESHOLDS.get(self.signal)

    def check_budget(self, budget_tokens: int) -> None:
        """Windows larger than the budget could never fire: refuse them with the numbers."""
        for name in ("window", "chunk_tokens", "min_tokens"):
            if getattr(self, name) > budget_tokens:
                raise ValueError(f"early stop {name}={getattr(self, name)} is larger than the "
                                 f"thinking budget ({budget_tokens} tokens): lower it or raise "
                                 "max_thinking_tokens")

    def build(self) -> "Signal":
        return SIGNALS[self.signal](self)


@dataclass(frozen=True)
class Probe:
    """A probe's completion: its text, its tokens' logprobs, and whether it ended at a
    ``probe_stop`` string (or EOS) rather than at ``probe_tokens``."""

    text: str
    logprobs: tuple[float, ...] = ()
    finished: bool = True

    @property
    def confidence(self) -> float:
        """Geometric-mean probability of its tokens (1.0 when the server returned none)."""
        return math.exp(sum(self.logprobs) / len(self.logprobs)) if self.logprobs else 1.0


@dataclass
class Chunk:
    """One generated chunk of a trace, as a signal sees it."""

    text: str
    tokens_so_far: int  # trace tokens including this chunk
    logprobs: list[float] = field(default_factory=list)  # chosen tokens
    top_logprobs: list[list[float]] = field(default_factory=list)  # per token, top-k
    # forks a probe off the trace and reads it; ``probe(drop)`` reads it from the trace
    # without its last ``drop`` characters (a probe at a cue the chunk ran past)
    probe: Callable[..., Probe] | None = None


@dataclass(frozen=True)
class StopDecision:
    signal: str
    at_token: int  # trace tokens when the decision was taken
    reason: str
    drop: bool = False  # the trace is abandoned (no answer from it), not merely closed
    answer_text: str | None = None  # the settled probe's completion, to answer with (probe)


class Signal(ABC):
    """Per-trace state; :meth:`observe` sees each chunk and may decide to stop.

    Contract: one instance per trace (``EarlyStop.build()``), chunks in order; it never sends
    requests itself except through ``chunk.probe``.
    """

    name: ClassVar[str]
    needs_logprobs: ClassVar[bool] = False
    needs_probe: ClassVar[bool] = False

    def __init__(self, config: EarlyStop):
        self.config = config

    @abstractmethod
    def observe(self, chunk: Chunk) -> StopDecision | None: ...

    def record(self, chunk: Chunk) -> StopDecision | None:
        """The trace's last chunk (it ended by itself): update statistics. Only a ``drop``
        decision makes sense here (a finished trace cannot be closed early)."""
        return None

    def weight(self) -> float:
        """Vote weight of the finished trace (1 unless the signal measures confidence)."""
        return 1.0


def register(name: str):
    def wrap(cls):
        cls.name = name
        SIGNALS[name] = cls
        return cls
    return wrap


def get_signal(name: str) -> type[Signal]:
    if name not in SIGNALS:
        raise ValueError(f"Unknown early-stop signal {name!r}. Supported signals: {sorted(SIGNALS)}")
    return SIGNALS[name]


def token_entropies(top_logprobs: list[list[float]]) -> list[float]:
    """Entropy (nats) of each token's distribution, estimated from its top-k renormalized."""
    out = []
    for lps in top_logprobs:
        if not lps:
            continue
        m = max(lps)
        ps = [math.exp(x - m) for x in lps]
        z = sum(ps)
        out.append(-sum(p / z * math.log(p / z) for p in ps if p > 0))
    return out
