"""Early-stop signals against the real server: assertions on tokens and cached prefill."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sgl_reason.early_stop import Chunk, EarlyStop, Probe, token_entropies
from sgl_reason.early_stop.consensus import ConsensusSignal, beta_majority_mass
from sgl_reason.profiles import Sampling
from sgl_reason.programs import ThinkingBudget, self_consistency, think_then_answer
from sgl_reason.vote import normalize_answer

QUESTION = "Tom has 3 boxes with 4 apples each. He eats 2 apples. How many apples are left?"
BUDGET = ThinkingBudget(max_thinking_tokens=96, max_answer_tokens=8)
GREEDY = Sampling(temperature=0.0)



@pytest.mark.server
def test_chunked_thinking_prefills_only_the_prompt_once(fresh_cache):
    """Six chunks and the answer are seven requests; the cache serves each one's prefix."""
    config = EarlyStop(signal="none", chunk_tokens=16, window=16)
    result = think_then_answer(QUESTION, budget=BUDGET, backend=fresh_cache.endpoint,
                               sampling=GREEDY, early_stop=config)
    sample, cost = result.samples[0], result.cost
    assert sample.thinking_tokens == 96 and sample.stopped is None  # the EOS is masked
    assert cost.requests == 7
    prompt = 53  # 45-token chat prompt + "Let's think step by step.\n"
    marker = result.info["marker_tokens"]
    # the prompt once; then each request continues the model's own tokens (token-exact), so
    # it prefills its one seam token (the last token decoded, whose KV no request computed yet)
    # and, for the answer, the marker
    assert cost.computed_prefill_tokens == prompt + (cost.requests - 1) + marker, cost


@pytest.mark.server
def test_entropy_stops_before_the_budget(runtime):
    config = EarlyStop(signal="entropy", chunk_tokens=16, window=16, threshold=10.0)
    result = think_then_answer(QUESTION, budget=BUDGET, backend=runtime.endpoint,
                               early_stop=config)
    sample = result.samples[0]
    assert sample.stopped["signal"] == "entropy" and sample.stopped["at_token"] == 16
    assert sample.thinking_tokens == 16 < BUDGET.thinking_tokens
    assert result.info["early_stop"] == sample.stopped
    assert "mean entropy" in sample.stopped["reason"]


@pytest.mark.server
def test_probes_reuse_the_cached_thinking(fresh_cache):
    config = EarlyStop(signal="probe", chunk_tokens=16, window=16, probe_tokens=6)
    result = think_then_answer(QUESTION, budget=BUDGET, backend=fresh_cache.endpoint,
                               sampling=GREEDY, early_stop=config)
    sample, cost = result.samples[0], result.cost
    chunks = -(-sample.thinking_tokens // 16)
    answered_by_probe = sample.stopped is not None and sample.stopped["answer_from_probe"]
    answers = 0 if answered_by_probe else 1
    probes = (cost.requests - chunks - answers) // 2  # each probe: a seam commit + the probe
    assert probes >= 2 and cost.requests == chunks + 2 * probes + answers
    marker = result.info["marker_tokens"]
    # the prompt once; one seam token per later chunk and per probe's commit; the marker for
    # every probe (and the seam and marker of the answer, if one was asked): a probe prefills
    # nothing of the thinking it forks from
    expected = 53 + (chunks - 1) + probes * (1 + marker) + answers * (1 + marker)
    assert cost.computed_prefill_tokens == expected, cost
    if sample.stopped is not None:
        assert sample.thinking_tokens < BUDGET.thinking_tokens
        assert "consecutive probes" in sample.stopped["reason"]
        # the settled probe is the answer: no answer request, its tokens are the probe's
        assert answered_by_probe and sample.answer_tokens == 0 and sample.answer is not None
        assert sample.stopped["reason"].endswith(repr(normalize_answer(sample.answer)))
    else:
        assert sample.thinking_tokens == BUDGET.thinking_tokens


@pytest.mark.server
def test_probes_cut_before_their_line_ends_never_settle(fresh_cache):
    # one token cannot hold an answer and its newline: every probe is cut, none counts
    config = EarlyStop(signal="probe", chunk_tokens=16, window=16, probe_tokens=1)
    result = think_then_answer(QUESTION, budget=BUDGET, backend=fresh_cache.endpoint,
                               sampling=GREEDY, early_stop=config)
    sample, cost = result.samples[0], result.cost
    assert sample.stopped is None and sample.thinking_tokens == BUDGET.thinking_tokens
    probes = BUDGET.thinking_tokens // 16 - 1  # after every chunk but the last
    assert cost.decode_tokens == sample.thinking_tokens + probes * 1 + sample.answer_tokens


def _fed(config: EarlyStop, probes: list[Probe]):
    """The probe signal's decisions over chunks of 16 whose probes return ``probes``."""
    signal = config.build()
    return [signal.observe(Chunk(text="", tokens_so_far=16 * (i + 1), probe=lambda p=p: p))
            for i, p in enumerate(probes)]


def test_probe_counts_only_finished_confident_answers():
    import math

    sure, unsure = (math.log(0.9),) * 3, (math.log(0.9), math.log(0.1), math.log(0.9))
    assert Probe(" 12", sure).confidence == pytest.approx(0.9)
    assert Probe(" 12", unsure).confidence == pytest.approx((0.9 * 0.1 * 0.9) ** (1 / 3))
    assert Probe(" 12").confidence == 1.0  # no logprobs returned: nothing to judge by
    plain = EarlyStop(signal="probe", chunk_tokens=16)
    decisions = _fed(plain, [Probe(" 12", unsure), Probe(" 12", unsure)])
    assert decisions[0] is None and decisions[1].at_token == 32
    assert decisions[1].answer_text == " 12"
    # a probe cut at probe_tokens states no answer, and breaks the run of equal ones
    cut = _fed(plain, [Probe(" 12", sure), Probe(" 12", sure, finished=False), Probe(" 12", sure)])
    assert cut == [None, None, None]
    strict = EarlyStop(signal="probe", chunk_tokens=16, probe_confidence=0.5)
    decisions = _fed(strict, [Probe(" 12", sure), Probe(" 12", unsure), Probe(" 12", sure),
                              Probe(" 12", sure)])
    assert decisions[:3] == [None, None, None] and decisions[3].at_token == 64
    assert "mean token probability >= 0.5" in decisions[3].reason


def test_probe_cues_probe_only_after_a_transition_word():
    """DEER's trigger: a chunk is probed only once the text since the last probe holds a cue
    (also when the cue is split across two chunks), and the probe reads the trace cut just
    before the cue; one confident probe may stop."""
    import math

    config = EarlyStop(signal="probe", chunk_tokens=16, probe_cues=("Check",), probe_agree=1,
                       probe_confidence=0.8)
    signal = config.build()
    asked = []

    def chunk(text, at, p):
        return Chunk(text=text, tokens_so_far=at, probe=lambda drop=0: asked.append(drop) or p)

    sure, unsure = Probe(" 12.\n", (math.log(0.95),) * 3), Probe(" 9.\n", (math.log(0.5),) * 3)
    assert signal.observe(chunk("Step 1: 3*4=12.", 16, sure)) is None  # no cue: no probe
    assert signal.observe(chunk(" So the result is 12.\nChe", 32, sure)) is None
    assert asked == []
    decision = signal.observe(chunk("ck: 12/4=3, right", 48, sure))  # "Che" + "ck"
    # the probe leaves out "\nCheck: 12/4=3, right": it reads "... the result is 12."
    assert asked == [len("\nCheck: 12/4=3, right")]
    assert decision.at_token == 48 and decision.answer_text == " 12.\n"
    assert "a probe (mean token probability >= 0.8) answered '12'" in decision.reason
    unsure_signal = config.build()
    assert unsure_signal.observe(Chunk(text="Check:", tokens_so_far=16,
                                       probe=lambda drop=0: unsure)) is None  # not sure enough
    with pytest.raises(ValidationError, match="probe_agree=1 stops at the first probe"):
        EarlyStop(signal="probe", probe_agree=1)
    with pytest.raises(ValidationError, match="non-empty strings"):
        EarlyStop(signal="probe", probe_cues=("",))


@pytest.mark.server
def test_confidence_drops_low_confidence_traces(runtime):
    strict = EarlyStop(signal="confidence", chunk_tokens=8, window=8, threshold=100.0)
    result = self_consistency(QUESTION, n=3, max_tokens=32, backend=runtime.endpoint,
                              early_stop=strict)
    for sample in result.samples:
        # dropped at its first chunk, or, if it ended by itself inside it, dropped all the same
        assert sample.stopped["drop"] and sample.answer is None and sample.answer_tokens <= 8
    assert result.answer is None  # nothing left to vote for
    lenient = EarlyStop(signal="confidence", chunk_tokens=8, window=8, threshold=1e-6)
    result = self_consistency(QUESTION, n=3, max_tokens=16, backend=runtime.endpoint,
                              early_stop=lenient)
    assert all(s.stopped is None and s.score > 0 for s in result.samples)
    total = sum(s.score for s in result.samples if s.answer)
    assert sum(result.vote.votes.values()) == pytest.approx(total)  # confidence-weighted vote


def test_warmup_threshold_keeps_the_top_fraction():
    from sgl_reason.early_stop.confidence import warmup_threshold

    confidences = [4.0, 1.0, 3.0, 2.0, 5.0]
    assert warmup_threshold(confidences, 1.0) == 1.0  # keep all: the lowest
    assert warmup_threshold(confidences, 0.5) == 3.0  # the median
    assert warmup_threshold(confidences, 0.1) == pytest.approx(4.6)  # DeepConf-low: 90th pct
    assert warmup_threshold([2.0], 0.1) == 2.0
    with pytest.raises(ValueError, match="no warm-up trace"):
        warmup_threshold([], 0.9)
    with pytest.raises(ValidationError):
        EarlyStop(signal="confidence", keep_top=0.0)


@pytest.mark.server
def test_deepconf_warmup_sets_the_threshold_and_filters_the_vote(runtime):
    """DeepConf online: W warm-up traces drawn whole set the threshold (their median here);
    later traces under it stop early and are dropped; warm-up traces under it do not vote."""
    config = EarlyStop(signal="confidence", chunk_tokens=16, window=16, warmup=2, keep_top=0.5)
    result = self_consistency(QUESTION, n=4, think=ThinkingBudget(max_thinking_tokens=64,
                                                                  max_answer_tokens=8),
                              backend=runtime.endpoint, early_stop=config)
    threshold = result.info["confidence_threshold"]
    warm, rest = result.samples[:2], result.samples[2:]
    assert len(result.samples) == 4 and threshold > 0
    assert all(x.thinking_tokens == 64 and x.stopped is None for x in warm)  # drawn whole
    assert sorted(x.score for x in warm)[0] == 0.0  # the one under the median is filtered out
    for x in rest:
        if x.stopped is not None:  # dropped at the first group under the threshold
            assert x.stopped["drop"] and x.answer is None and x.score == 0.0
        else:
            assert x.score >= threshold
    assert result.cost.thinking_tokens == sum(x.thinking_tokens for x in result.samples)


@pytest.mark.server
def test_consensus_stops_sampling_when_unanimous(runtime):
    config = EarlyStop(signal="consensus", batch=4)
    result = self_consistency(QUESTION, n=12, max_tokens=16, backend=runtime.endpoint,
                              sampling=GREEDY, early_stop=config)
    assert result.info["samples_drawn"] == 4 and len(result.samples) == 4
    assert result.info["early_stop"]["signal"] == "consensus"
    assert result.cost.decode_tokens <= 4 * 16


def test_beta_rule():
    assert beta_majority_mass(2, 2) == pytest.approx(0.5, abs=1e-3)
    assert beta_majority_mass(9, 1) > 0.95 > beta_majority_mass(3, 1)
    judge = ConsensusSignal(EarlyStop(signal="consensus"))
    assert judge.settled(["1", "2", "1", "3"], ["1", "3"], 4) is None
    assert judge.settled(["1"] * 3 + ["2"], ["1", "1"], 4).reason.startswith("window of 2 unanimous")


def test_token_entropies():
    import math

    assert token_entropies([[0.0]]) == [0.0]
    assert token_entropies([[math.log(0.5), math.log(0.5)]])[0] == pytest.approx(math.log(2))


def test_bad_input_names_the_fix():
    with pytest.raises(ValidationError, match=r"Supported signals: \['confidence', 'consensus'"):
        EarlyStop(signal="vibes")
    with pytest.raises(ValidationError, match="out of range"):
        EarlyStop(signal="entropy", threshold=-0.5)
    with pytest.raises(ValidationError, match="out of range"):
        EarlyStop(signal="confidence", threshold=0.0)
    with pytest.raises(ValidationError):
        EarlyStop(signal="consensus", confidence_level=1.5)
    with pytest.raises(ValidationError, match="probe_confidence"):
        EarlyStop(signal="probe", probe_confidence=1.0)
    with pytest.raises(ValueError, match="window=200 is larger than the thinking budget"):
        EarlyStop(signal="entropy", window=200).check_budget(96)
    with pytest.raises(ValueError, match="consensus signal stops sampling"):
        think_then_answer(QUESTION, early_stop=EarlyStop(signal="consensus"), backend=object())
    with pytest.raises(ValueError, match="pass think="):
        self_consistency(QUESTION, early_stop=EarlyStop(signal="probe"), backend=object())


def test_a_traces_confidence_read_at_once_is_the_signals_weight():
    """trace_confidence (a weighted vote's score, read off one request) equals what the
    confidence signal weighs the same tokens by, read chunk by chunk."""
    import random

    from sgl_reason.early_stop.confidence import trace_confidence

    rng = random.Random(0)
    rows = [sorted((-rng.expovariate(1.0) for _ in range(5)), reverse=True) for _ in range(150)]
    for n in (150, 40, 32, 9):
        signal = EarlyStop(signal="confidence", window=32).build()
        for at in range(0, n, 7):
            end = min(at + 7, n)
            signal.observe(Chunk(text="", tokens_so_far=end, top_logprobs=rows[at:end]))
        assert trace_confidence(rows[:n]) == pytest.approx(signal.weight())
    assert trace_confidence([]) is None and trace_confidence([[-1.0, -3.0]]) == 2.0
    # a token a logit processor forced (one real logprob, the rest masked: float32's lowest,
    # as the server reports -inf) is the processor's choice, not the model's: left out
    forced = [0.0] + [-3.4028234663852886e38] * 4
    assert trace_confidence(rows[:40] + [forced] * 3) == pytest.approx(trace_confidence(rows[:40]))
    signal = EarlyStop(signal="confidence", window=32).build()
    signal.observe(Chunk(text="", tokens_so_far=43, top_logprobs=rows[:40] + [forced] * 3))
    assert signal.weight() == pytest.approx(trace_confidence(rows[:40]))
