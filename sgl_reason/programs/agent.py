"""A multi-step agent that reasons at every step and carries only its answers forward.

A plan of K steps over a shared context (the seed's workload C). Step k's prompt is the context,
then each earlier step as a user turn and its *answer* as the assistant turn, then step k; the
step thinks (:func:`~sgl_reason.think`) and answers. Earlier steps' thinking is dropped from the
context, as Qwen3's chat template drops earlier turns' thinking, so:

- every step's prompt extends the cached context: the radix cache serves the context and the
  earlier turns; each step computes only its last answer and its own instruction;
- each step's thinking KV is freed when the step ends (``kv_policy="strip"`` where the server has
  sgl-reason's thinking-KV cache): the pool holds the context and the answers, not K traces;
- a step's budget shrinks as the run's budget is spent: step k may think for its fair share of
  what is left, ``remaining // steps_left``, clamped to ``[min_step_budget, step_budget]``.

``carry="everything"`` is the naive baseline: earlier turns keep their whole thinking.
A step may name the previous step's answer as ``{prev}`` (the program fills it in), which is how
the steps of a plan depend on each other.
"""

from __future__ import annotations

from typing import Literal

import sglang as sgl

from sgl_reason.backend import ReasonBackend
from sgl_reason.profiles import ModelProfile, Sampling
from sgl_reason.programs.budget import ThinkingBudget, check_kv_policy
from sgl_reason.programs.common import (
    ProgramResult, Sample, prompt_texts, resolve_backend, resolve_profile, sampling_kwargs,
    timed_cost,
)
from sgl_reason.programs.think_then_answer import ThinkPlan, think


@sgl.function
def agent_step_program(s, context, turns, step, plan):
    """One step: the context, earlier (step, reply) turns, this step; think, then answer."""
    s += sgl.system(context)
    for question, reply in turns:
        s += sgl.user(question)
        s += sgl.assistant(reply)
    s += sgl.user(step)
    s += sgl.assistant_begin()
    s["sample"] = think(s, plan)


def step_budgets(total: int | None, step_budget: int, min_step_budget: int, steps_left: int,
                 spent: int) -> int:
    """The thinking budget of the next step: its fair share of what the run has left."""
    if total is None:
        return step_budget
    share = max(0, total - spent) // max(1, steps_left)
    return max(min_step_budget, min(step_budget, share))


def agent_steps(
    context: str,
    steps: list[str],
    *,
    step_budget: int = 256,
    total_budget: int | None = None,
    min_step_budget: int = 16,
    max_answer_tokens: int = 64,
    carry: Literal["answers", "everything"] = "answers",
    kv_policy: str | None = "auto",
    first: str = "",
    backend: ReasonBackend | None = None,
    profile: ModelProfile | None = None,
    sampling: Sampling | None = None,
    normalize_prompt: bool = True,
) -> ProgramResult:
    """Run the plan ``steps`` over ``context``; return the last step's answer.

    ``samples[k]`` is step k's sample; ``info`` has each step's ``answers``, ``budgets`` and
    ``prompt_tokens``. ``kv_policy``: ``"auto"`` strips each step's thinking KV where the server
    can (``--thinking-kv-policy``) and sends none elsewhere; or any policy, or None for the
    server's default. ``first`` fills ``{prev}`` in the first step.
    """
    if not steps:
        raise ValueError("steps is empty: pass the plan as a list of step instructions.")
    if carry not in ("answers", "everything"):
        raise ValueError(f"carry must be 'answers' or 'everything', got {carry!r}")
    if not 1 <= min_step_budget <= step_budget:
        raise ValueError(f"need 1 <= min_step_budget ({min_step_budget}) <= step_budget "
                         f"({step_budget})")
    backend = resolve_backend(backend)
    profile = resolve_profile(backend, profile)
    if kv_policy == "auto":
        kv_policy = "strip" if backend.thinking_kv else None
    check_kv_policy(kv_policy)
    params = sampling_kwargs(profile, sampling)
    context = prompt_texts(context, None, normalize_prompt)[0]
    turns: list[tuple[str, str]] = []
    samples: list[Sample] = []
    budgets, prompts, spent, prev = [], [], 0, first
    with timed_cost(backend) as cost:
        for k, template in enumerate(steps):
            step = template.replace("{prev}", prev if prev is not None else "unknown")
            step = prompt_texts(step, None, normalize_prompt)[0]
            question = f"{step}\n{profile.answer_format}" if profile.answer_format else step
            budget = step_budgets(total_budget, step_budget, min_step_budget, len(steps) - k,
                                  spent)
            plan = ThinkPlan(backend, profile, ThinkingBudget(
                max_thinking_tokens=budget, max_answer_tokens=max_answer_tokens), params,
                kv_policy=kv_policy)
            before = backend.recorder.snapshot()
            state = agent_step_program.run(context=context, turns=list(turns), step=question,
                                           plan=plan, backend=backend)
            sample: Sample = state["sample"]
            prompts.append(backend.recorder.snapshot().prompt_tokens - before.prompt_tokens)
            samples.append(sample)
            budgets.append(budget)
            spent += sample.thinking_tokens
            reply = (sample.answer_text if carry == "answers"
                     else profile.think_start + sample.text)
            turns.append((question, reply.strip()))
            prev = sample.answer
        total = cost()
    total.thinking_tokens = sum(x.thinking_tokens for x in samples)
    total.answer_tokens = sum(x.answer_tokens for x in samples)
    return ProgramResult(
        answer=samples[-1].answer, samples=samples, cost=total,
        info={"answers": [x.answer for x in samples], "budgets": budgets,
              "prompt_tokens": prompts, "carry": carry, "kv_policy": kv_policy,
              "profile": profile.name})
