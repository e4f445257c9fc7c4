"""Problem sets with graders: JSONL files (GSM8K's ``#### N`` understood) and reasoning-gym.

A source is a path to a JSONL file with ``question`` and ``answer`` fields (and optionally
``family``, which splits the accuracy in eval summaries), or
``reasoning-gym:NAME[?size=K&seed=S]`` for one of reasoning-gym's seeded generators.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs

from sgl_reason.vote import extract_gsm8k_gold, normalize_answer, parse_number

GYM_PREFIX = "reasoning-gym:"


@dataclass
class Problem:
    id: str  # stable within the source: the line number or the generator's index
    question: str
    gold: str
    grade: Callable[[str | None], bool] = field(repr=False)
    family: str | None = None  # the record's "family" field (per-family accuracy), if any


class DataError(ValueError):
    """A data source could not be read; the message names the file, line or field."""


def answers_match(prediction: str | None, gold: str) -> bool:
    """Numbers compare exactly as rationals; other answers by their normalized text."""
    if prediction is None:
        return False
    a, b = parse_number(prediction), parse_number(gold)
    if a is not None and b is not None:
        return a == b
    return normalize_answer(prediction) == normalize_answer(gold)


def load_jsonl(path: str | Path) -> list[Problem]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"Data file {str(path)!r} does not exist. Pass a JSONL file with "
                        "'question' and 'answer' fields, or reasoning-gym:NAME.")
    problems = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            for key in ("question", "answer"):
                if key not in record:
                    raise DataError(f"{path}:{number}: the record has no {key!r} field "
                                    f"(fields: {sorted(record)})")
            answer = str(record["answer"])
            gold = extract_gsm8k_gold(answer) if "####" in answer else answer.strip()
            problems.append(Problem(str(number), record["question"], gold,
                                    lambda p, g=gold: answers_match(p, g),
                                    family=record.get("family")))
    return problems


def load_reasoning_gym(spec: str) -> list[Problem]:
    """``NAME[?size=K&seed=S]`` (defaults: size 50, seed 0), graded by the generator itself.

    reasoning-gym draws item i from seed S + i: sets whose seeds are less than their size apart
    share problems (seed 1 is seed 0 shifted by one). Held-out sets need seeds far apart."""
    name, _, query = spec.partition("?")
    options = {k: int(v[-1]) for k, v in parse_qs(query).items()}
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        import difflib

        near = difflib.get_close_matches(name, DATASETS, n=3)
        hint = f" Did you mean {' or '.join(near)}?" if near else ""
        raise DataError(f"reasoning-gym has no dataset {name!r}.{hint} Its datasets: "
                        f"{', '.join(sorted(DATASETS))}")
    try:
        dataset = reasoning_gym.create_dataset(name, size=options.get("size", 50),
                                               seed=options.get("seed", 0))
    except Exception as error:  # noqa: BLE001  (reasoning-gym raises plain errors)
        raise DataError(f"reasoning-gym has no usable dataset {name!r}: {error}") from None
    return gym_problems(name, dataset)


def gym_problems(name: str, dataset) -> list[Problem]:
    """The problems of a reasoning-gym dataset object, graded by its own ``score_answer``."""
    problems = []
    for i in range(len(dataset)):
        entry = dataset[i]
        problems.append(Problem(
            str(i), entry["question"], str(entry["answer"]),
            lambda p, e=entry: p is not None and dataset.score_answer(p, e) >= 1.0,
            family=name,
        ))
    return problems


def load(source: str) -> list[Problem]:
    if source.startswith(GYM_PREFIX):
        return load_reasoning_gym(source[len(GYM_PREFIX):])
    return load_jsonl(source)


def load_problems(source: str) -> list[Problem]:
    """A problem set: a JSONL file (question/answer, optional family; GSM8K's ``#### N``
    understood) or ``reasoning-gym:NAME[?size=K&seed=S]``. ``problem.grade(answer)`` grades."""
    return load(source)
