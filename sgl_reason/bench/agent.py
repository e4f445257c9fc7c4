"""``sgl-reason bench agent``: a K-step agent that carries its answers forward against the
naive one that carries all its thinking.

Two plans over a shared context. ``farm`` (the default): K leg-counting questions from
reasoning-gym (the reasoner's best family; seeds from 6,000,000, never trained on), each
answered on its own, so answers can be compared step by step. ``till``: K steps ``{prev} + a -
b`` on the previous step's answer (chain_sum), where one wrong step changes every later
question. Two rows on one reasoner server (``--thinking-kv-policy keep``, so a request can ask
for ``strip``), each after a cache flush, both greedy with the same budgets:

| row | earlier turns in each prompt | step thinking KV |
|---|---|---|
| ``steps`` | the answers only (:func:`~sgl_reason.programs.agent.agent_steps`) | stripped at the step's end |
| ``naive`` | thinking and answers (``carry="everything"``) | kept |

Figures: prefill computed and prompt tokens (the server's counts), peak KV (the largest request:
its prompt plus what it generated, which is what the run's last step holds), decoded tokens,
wall time, and the answers: agreement step by step and each row's accuracy (``till``: a step is
right when it computes ``prev + a - b`` from its own ``prev``).

``--agents M`` runs M agents at once in each row, each on its own questions, as on a server that
many users' agents share; with ``--max-total-tokens`` the pool is fixed, so what an agent carries
competes for it: a naive agent's history that the pool cannot keep cached is prefilled again at
its next step. Token counts are summed over the agents, peak KV is the largest request's.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from sgl_reason.backend import ReasonBackend
from sgl_reason.bench import publish
from sgl_reason.data import answers_match
from sgl_reason.profiles import Sampling
from sgl_reason.programs.agent import agent_steps

logger = logging.getLogger(__name__)

CONTEXT = ("You keep the books of a small shop. The till holds {start} dollars when the day "
           "begins. Each step gives one sale and one expense; work out the till's new total "
           "from the total of the step before.")
STEP = "State the final answer to the following arithmetic problem: {{prev}} + {a} - {b} ="


FARM = ("You are counting animal legs on a farm, one pen at a time. Each question is about "
        "its own pen.")
FARM_SEED = 6_000_000


def farm_plan(steps: int, seed: int = 0) -> tuple[str, list[str], list[str]]:
    """The farm's context, K leg-counting questions and their gold answers."""
    from sgl_reason.reasoner.traces import dataset

    ds = dataset("leg_counting", steps, FARM_SEED + seed)
    items = [ds[i] for i in range(steps)]
    return FARM, [x["question"] for x in items], [str(x["answer"]) for x in items]


def plan(steps: int, seed: int) -> tuple[str, list[str], list[tuple[int, int]], int]:
    rng = random.Random(seed)
    start = rng.randint(100, 300)
    moves = [(rng.randint(10, 60), rng.randint(5, 40)) for _ in range(steps)]
    return CONTEXT.format(start=start), [STEP.format(a=a, b=b) for a, b in moves], moves, start


def _grade(answers: list[str | None], moves: list[tuple[int, int]], start: int) -> dict:
    local, chain, prev, truth, chain_ok = 0, 0, str(start), start, True
    for answer, (a, b) in zip(answers, moves):
        try:
            expected = str(int(prev) + a - b)
        except (TypeError, ValueError):
            expected = None
        local += expected is not None and answers_match(answer, expected)
        truth += a - b
        chain_ok = chain_ok and answers_match(answer, str(truth))
        chain += chain_ok
        prev = answer
    n = len(moves)
    return {"step_accuracy": round(local / n, 4), "chain_correct_steps": chain}


def _row(result, grade: dict) -> dict:
    c = result.cost
    return {"computed_prefill_tokens": c.computed_prefill_tokens,
            "prompt_tokens": c.prompt_tokens, "peak_kv_tokens": c.peak_request_tokens,
            "decode_tokens": c.decode_tokens, "thinking_tokens": c.thinking_tokens,
            "answer_tokens": c.answer_tokens, "requests": c.requests,
            "seconds": round(c.seconds, 2), "kv_token_seconds": round(c.kv_token_seconds),
            "forced_steps": sum(x.forced for x in result.samples),
            "last_prompt_tokens": result.info["prompt_tokens"][-1], **grade}


@dataclass
class AgentPlan:
    """One agent's work: its context, its K steps, ``{prev}``'s first value, and a grader of its
    answers."""
    context: str
    steps: list[str]
    first: str
    grade: Callable[[list], dict]


def agent_plans(plan_name: str, steps: int, seed: int, agents: int = 1) -> list[AgentPlan]:
    """``agents`` plans of ``steps`` steps; no two agents share a question."""
    plans = []
    if plan_name == "farm":
        context, questions, golds = farm_plan(steps * agents, seed)
        for i in range(agents):
            mine = slice(i * steps, (i + 1) * steps)
            plans.append(AgentPlan(context, questions[mine], "", lambda answers, g=golds[mine]: {
                "step_accuracy": round(sum(answers_match(a, x) for a, x in zip(answers, g))
                                       / len(g), 4)}))
    elif plan_name == "till":
        for i in range(agents):
            context, questions, moves, start = plan(steps, seed + i)
            plans.append(AgentPlan(context, questions, str(start),
                                   lambda answers, m=moves, s=start: _grade(answers, m, s)))
    else:
        raise ValueError(f"unknown plan {plan_name!r}: farm or till")
    return plans


def _merge(rows: list[dict], seconds: float) -> dict:
    """Agents' rows as one: token counts summed, peaks the largest, accuracy the mean."""
    out = {k: sum(r[k] for r in rows) for k in (
        "computed_prefill_tokens", "prompt_tokens", "decode_tokens", "thinking_tokens",
        "answer_tokens", "requests", "kv_token_seconds", "forced_steps")}
    out["peak_kv_tokens"] = max(r["peak_kv_tokens"] for r in rows)
    out["last_prompt_tokens"] = max(r["last_prompt_tokens"] for r in rows)
    out["seconds"] = round(seconds, 2)
    for key in ("step_accuracy", "chain_correct_steps"):
        if key in rows[0]:
            out[key] = round(sum(r[key] for r in rows) / len(rows), 4)
    return out


def run(backend: ReasonBackend, steps: int = 30, seed: int = 0, step_budget: int = 128,
        total_budget: int | None = None, max_answer_tokens: int = 48,
        plan_name: str = "farm", agents: int = 1) -> dict:
    """Both rows, each after a cache flush; ``agents`` agents at once share the server (their
    token counts summed), as on a server that many users' agents share."""
    if agents < 1:
        raise ValueError(f"agents must be at least 1, got {agents}")
    plans = agent_plans(plan_name, steps, seed, agents)
    common = dict(step_budget=step_budget, total_budget=total_budget,
                  max_answer_tokens=max_answer_tokens, backend=backend,
                  sampling=Sampling(temperature=0))
    results, rows = {}, {}
    for name, carry in (("steps", "answers"), ("naive", "everything")):
        backend.flush_cache()
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=agents) as pool:
            results[name] = list(pool.map(lambda p, carry=carry: agent_steps(
                p.context, p.steps, carry=carry, first=p.first,
                kv_policy="strip" if carry == "answers" else "keep", **common), plans))
        rows[name] = _merge([_row(r, p.grade(r.info["answers"]))
                             for r, p in zip(results[name], plans)],
                            time.perf_counter() - started)
        logger.info("%s: %s", name, rows[name])
    a = [x for r in results["steps"] for x in r.info["answers"]]
    b = [x for r in results["naive"] for x in r.info["answers"]]
    s, n = rows["steps"], rows["naive"]
    return {
        "model": backend.get_model_name(), "plan": plan_name, "steps": steps, "seed": seed,
        "agents": agents, "pool_tokens": backend.server_info.get("max_total_num_tokens"),
        "step_budget": step_budget, "total_budget": total_budget,
        "prefill_ratio_vs_naive": round(s["computed_prefill_tokens"]
                                        / n["computed_prefill_tokens"], 3),
        "prompt_ratio_vs_naive": round(s["prompt_tokens"] / n["prompt_tokens"], 3),
        "peak_kv_ratio_vs_naive": round(s["peak_kv_tokens"] / n["peak_kv_tokens"], 3),
        "decode_ratio_vs_naive": round(s["decode_tokens"] / n["decode_tokens"], 3),
        "time_ratio_vs_naive": round(s["seconds"] / n["seconds"], 3),
        "answer_agreement": round(sum(x == y for x, y in zip(a, b)) / len(a), 4),
        "final_answers": [[r.info["answers"][-1] for r in results[name]]
                          for name in ("steps", "naive")],
        "rows": rows,
        "budgets": {name: [r.info["budgets"] for r in rs] for name, rs in results.items()},
    }


def table(report: dict) -> str:
    keys = ("computed_prefill_tokens", "prompt_tokens", "peak_kv_tokens", "decode_tokens",
            "seconds", "step_accuracy")
    lines = [f"{'row':6} " + " ".join(f"{k[:16]:>16}" for k in keys)]
    for name, r in report["rows"].items():
        lines.append(f"{name:6} " + " ".join(f"{r[k]:>16}" for k in keys))
    lines.append(
        f"{report['agents']} x {report['steps']} steps: prefill "
        f"{report['prefill_ratio_vs_naive']:.3f}x naive, "
        f"peak KV {report['peak_kv_ratio_vs_naive']:.3f}x, prompt tokens "
        f"{report['prompt_ratio_vs_naive']:.3f}x, time {report['time_ratio_vs_naive']:.3f}x; "
        f"answers agree on {report['answer_agreement']:.0%} of steps")
    return "\n".join(lines)


def main(args) -> int:
    from sgl_reason.connection import connect

    if args.url:
        conn = connect(args.url)
    else:
        pool = ["--max-total-tokens", str(args.max_total_tokens)] if args.max_total_tokens else []
        conn = connect(model=args.model,
                       extra_args=["--thinking-kv-policy", "keep", *pool, *args.server_arg])
    with conn as backend:
        report = run(backend, steps=args.steps, seed=args.seed, step_budget=args.step_budget,
                     total_budget=args.total_budget, plan_name=args.plan, agents=args.agents)
    publish(report, table(report), args.json)
    return 0
