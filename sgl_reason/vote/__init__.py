"""Answer extraction and voting over sampled answers (self-consistency).

``extract_answer`` pulls the final answer out of each completion; a ``Voter`` (``exact``,
``fuzzy`` or ``semantic``, chosen by ``VoteConfig.method``) picks the answer most samples
agree on and reports the vote as a ``VoteResult``.
"""

from .extract import extract_answer, extract_gsm8k_gold, normalize_answer, parse_number
from .voters import (
    VOTERS,
    ExactVoter,
    FuzzyVoter,
    SemanticVoter,
    VoteConfig,
    Voter,
    VoteResult,
    get_voter,
    vote,
)

__all__ = [
    "extract_answer",
    "parse_number",
    "normalize_answer",
    "extract_gsm8k_gold",
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
