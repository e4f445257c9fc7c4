"""Reasoning programs: each a plain ``@sgl.function`` plus a typed entry point.

| program | entry point | module |
|---|---|---|
| prefix-shared self-consistency | :func:`self_consistency` | ``self_consistency.py`` |
| budgeted think-then-answer | :func:`think_then_answer` | ``think_then_answer.py`` |
| best-of-N with a verifier | :func:`best_of_n` | ``best_of_n.py`` |
| a verifier that recomputes the candidate's arithmetic | :func:`arithmetic_verifier` | ``verifiers.py`` |
| multi-step agent, answers carried | :func:`agent_steps` | ``agent.py`` |
"""

from sgl_reason.programs.agent import agent_step_program, agent_steps
from sgl_reason.programs.best_of_n import best_of_n, best_of_n_program, p_yes_verifier
from sgl_reason.programs.budget import TIERS, KVPolicy, ThinkingBudget
from sgl_reason.programs.common import ProgramResult, Sample
from sgl_reason.programs.self_consistency import self_consistency, self_consistency_program
from sgl_reason.programs.think_then_answer import think_then_answer, think_then_answer_program
from sgl_reason.programs.verifiers import arithmetic_verifier, check_arithmetic

__all__ = [
    "KVPolicy", "ProgramResult", "Sample", "TIERS", "ThinkingBudget",
    "agent_step_program", "agent_steps", "arithmetic_verifier", "check_arithmetic",
    "best_of_n", "best_of_n_program", "p_yes_verifier",
    "self_consistency", "self_consistency_program",
    "think_then_answer", "think_then_answer_program",
]
