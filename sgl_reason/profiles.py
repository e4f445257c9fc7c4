"""Model profiles: how a model family marks its thinking, formats answers and likes to sample.

A profile is chosen from the served model's name (:func:`profile_for`), or passed explicitly.
Token ids of the markers are not stored here: they depend on the tokenizer, so programs ask the
server (``/tokenize``) once per backend.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Sampling(BaseModel):
    """Recommended sampling for reasoning with this family."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(0.6, ge=0)
    top_p: float = Field(0.95, gt=0, le=1)
    top_k: int = -1
    # Keep only tokens at least this share of the likeliest one's probability (min-p sampling;
    # 0 turns it off). It cuts the unlikely tail, such as a wrong digit in a copied number,
    # and keeps near-even choices, such as which way to work a problem.
    min_p: float = Field(0.0, ge=0, le=1)
    # Generate to the token limit regardless of EOS (benchmarks that need equal lengths).
    ignore_eos: bool = False


class ModelProfile(BaseModel):
    """What a program needs to know about a model family's thinking format."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    # Lower-case substrings of the served model's path or name that select this profile.
    match: tuple[str, ...] = ()
    # Whether the model was trained to think between think_start and think_end.
    native_thinking: bool
    # Text the program appends after the assistant turn opens, to start thinking.
    think_start: str
    # End-of-thinking marker; budget forcing writes exactly this text.
    think_end: str
    # The end marker as the model emits it, when it is one token of the model's vocabulary
    # (Qwen3's and R1's "</think>"). Detection (budget forcing, the single-request route,
    # thinking-KV release) matches this token, so it is found however the tokenizer merges the
    # text around it (".\n" then "</think>"); without it, the whole think_end text is matched.
    end_token: str | None = None
    # Appended to the question: how the final answer should be written.
    answer_format: str = "Put the final answer within \\boxed{}."
    # Continuation used to extend thinking that closed before the minimum (s1's "Wait").
    wait_text: str = "\nWait,"
    # A short prompt that makes the model state its current answer (probes, fallbacks).
    answer_probe: str = "\n\nThe final answer is"
    # Words with which the model turns from working a result out to checking it: where a
    # probe with ``probe_cues`` asks for the answer (DEER's transition points).
    transition_cues: tuple[str, ...] = ("Wait", "Alternatively", "Hmm")
    sampling: Sampling = Sampling()

    @property
    def end_marker(self) -> str:
        """The text whose token ids detection matches: ``end_token``, else ``think_end``."""
        return self.end_token or self.think_end


QWEN3 = ModelProfile(
    name="qwen3", match=("qwen3",), native_thinking=True,
    think_start="<think>\n", think_end="\n</think>\n\n", end_token="</think>",
    sampling=Sampling(temperature=0.6, top_p=0.95, top_k=20),
)
QWQ = ModelProfile(
    name="qwq", match=("qwq",), native_thinking=True,
    think_start="<think>\n", think_end="\n</think>\n\n", end_token="</think>",
    sampling=Sampling(temperature=0.6, top_p=0.95, top_k=40),
)
DEEPSEEK_R1 = ModelProfile(
    name="deepseek-r1", match=("deepseek-r1", "r1-distill", "deepseek_r1"), native_thinking=True,
    think_start="<think>\n", think_end="\n</think>\n\n", end_token="</think>",
    answer_format="Please reason step by step, and put your final answer within \\boxed{}.",
    sampling=Sampling(temperature=0.6, top_p=0.95),
)
# For models without thinking tokens (the offline default, SmolLM2): the program opens a
# reasoning section in plain text and budget forcing closes it with a plain-text marker that
# also asks for the answer. "</" starts the marker because it is rare in math prose.
PROMPTED = ModelProfile(
    name="prompted", native_thinking=False,
    think_start="Let's think step by step.\n",
    think_end="\n</reasoning>\nFinal answer:",
    answer_format="Think step by step, then give the final answer as a number.",
    sampling=Sampling(temperature=0.7, top_p=0.95),
)

# sgl-reason's own tiny reasoner (``sgl-reason model prepare --model reasoner``): SmolLM2-135M
# fine-tuned on code-written traces (sgl_reason/reasoner/). "<think>" and "</think>" are added
# single tokens; the model ends its answer with "The answer is X." and needs no format prompt.
REASONER = ModelProfile(
    name="reasoner", match=("sgl-reason-reasoner",), native_thinking=True,
    think_start="<think>\n", think_end="\n</think>\n", end_token="</think>", answer_format="",
    answer_probe="The answer is", transition_cues=("Check", "Wait"),
    sampling=Sampling(temperature=0.7, top_p=0.95),
)

PROFILES: dict[str, ModelProfile] = {
    p.name: p for p in (QWEN3, QWQ, DEEPSEEK_R1, REASONER, PROMPTED)
}


def get_profile(name: str) -> ModelProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"Unknown profile {name!r}. Supported profiles: {sorted(PROFILES)}") from None


def profile_for(model_name: str) -> ModelProfile:
    """The first profile whose ``match`` occurs in the model's name; ``prompted`` otherwise."""
    lowered = model_name.lower()
    for profile in PROFILES.values():
        if any(m in lowered for m in profile.match):
            return profile
    return PROMPTED
