"""Data sources, graders and the resumable runner (a scripted program, no server), plus the
GSM8K recipe end to end on the real server."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sgl_reason.cost import Cost
from sgl_reason.data import DataError, answers_match, load
from sgl_reason.evaluate import read_records, run, summary_path
from sgl_reason.programs import ProgramResult, Sample

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT / "data" / "gsm8k" / "test.jsonl"


def test_gsm8k_gold_is_the_number_after_hashes():
    problems = load(str(GSM8K))
    assert len(problems) == 1319
    assert problems[0].gold == "18" and problems[0].grade("18.00") and not problems[0].grade("17")


def test_jsonl_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "1"}\n{"answer": "2"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: the record has no 'question' field"):
        load(str(bad))
    with pytest.raises(DataError, match="does not exist"):
        load(str(tmp_path / "missing.jsonl"))


def test_reasoning_gym_source_is_seeded_and_graded():
    a = load("reasoning-gym:basic_arithmetic?size=5&seed=3")
    b = load("reasoning-gym:basic_arithmetic?size=5&seed=3")
    assert [p.question for p in a] == [p.question for p in b] and len(a) == 5
    assert a[0].grade(a[0].gold) and not a[0].grade(None)
    with pytest.raises(DataError, match=r"no dataset 'chain_summ'\. Did you mean chain_sum"
                                         r"(.|\n)*Its datasets: .*basic_arithmetic"):
        load("reasoning-gym:chain_summ")


def test_answers_match():
    assert answers_match("1,000", "1000") and answers_match("0.5", "1/2")
    assert not answers_match("41", "42") and not answers_match(None, "1")


def scripted(answers: dict[str, str | None], calls: list[str]):
    def program(question: str) -> ProgramResult:
        calls.append(question)
        a = answers[question]
        return ProgramResult(answer=a, samples=[Sample(text=str(a), answer_text=str(a), answer=a)],
                             cost=Cost(requests=1, decode_tokens=10, prompt_tokens=5))
    return program


def test_runner_writes_records_and_resumes(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n"
                            for i in range(4)))
    problems = load(str(data))
    out = tmp_path / "out.jsonl"
    calls: list[str] = []
    answers = {"q0": "0", "q1": "5", "q2": None, "q3": "3"}
    summary = run(scripted(answers, calls), problems[:2], out, progress=False)
    assert summary["problems"] == 2 and summary["accuracy"] == 0.5
    summary = run(scripted(answers, calls), problems, out, progress=False)
    assert sorted(calls) == ["q0", "q1", "q2", "q3"]  # q0, q1 were not run again
    assert summary["problems"] == 4 and summary["accuracy"] == 0.5
    assert summary["extraction_rate"] == 0.75 and summary["tokens_per_problem"] == 10
    assert json.loads(summary_path(out).read_text())["problems"] == 4
    with open(out, "a") as f:
        f.write('{"id": "trunc')  # an interrupted write leaves a partial line
    assert len(read_records(out)) == 4


def test_records_carry_token_counts_and_the_summary_splits_by_family(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i),
                                        "family": "a" if i < 2 else "b"}) + "\n"
                            for i in range(4)))

    def program(question: str) -> ProgramResult:
        i = int(question[1:])
        s = Sample(text="", answer_text=str(i % 3), answer=str(i % 3), thinking_tokens=10 * i,
                   answer_tokens=5, forced=i == 3)
        return ProgramResult(answer=s.answer, samples=[s], cost=Cost(requests=1))

    summary = run(program, load(str(data)), tmp_path / "out.jsonl", progress=False)
    record = next(r for r in read_records(tmp_path / "out.jsonl") if r["id"] == "4")
    assert (record["family"], record["thinking_tokens"], record["answer_tokens"],
            record["forced"], record["correct"]) == ("b", 30, 5, True, False)
    assert summary["families"]["a"]["accuracy"] == 1.0  # q0 -> 0, q1 -> 1
    assert summary["families"]["b"]["accuracy"] == 0.5  # q2 -> 2, q3 -> 0
    assert summary["families"]["b"]["closed_rate"] == 0.5 and summary["closed_rate"] == 0.75


@pytest.mark.server
def test_gsm8k_recipe_runs_on_the_real_server(runtime, tmp_path):
    out = tmp_path / "sc.jsonl"
    subprocess.run(
        [sys.executable, str(ROOT / "programs" / "gsm8k_self_consistency.py"), "--limit", "2",
         "--n", "2", "--max-thinking-tokens", "16", "--max-answer-tokens", "8", "--out", str(out),
         "--url", runtime.url],
        check=True, timeout=300,
    )
    records = read_records(out)
    assert len(records) == 2 and all(len(r["samples"]) == 2 for r in records)
    assert all(r["cost"]["requests"] == 3 for r in records)
    assert json.loads(summary_path(out).read_text())["problems"] == 2


def test_records_end_in_input_order_and_wall_time_adds_up_over_resumed_runs(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n"
                            for i in range(6)))
    problems, out = load(str(data)), tmp_path / "out.jsonl"

    def program(question: str) -> ProgramResult:
        time.sleep(0.05 * (6 - int(question[1:])))  # later problems finish first
        return ProgramResult(answer="0", samples=[], cost=Cost(requests=1, seconds=1.0))

    first = run(program, problems[:3], out, concurrency=3, progress=False)
    assert [r["id"] for r in read_records(out)] == ["1", "2", "3"]
    second = run(program, problems, out, concurrency=6, progress=False)
    assert [r["id"] for r in read_records(out)] == ["1", "2", "3", "4", "5", "6"]
    assert second["wall_seconds"] > first["wall_seconds"] > 0
    assert second["problem_seconds"] == 6.0  # each problem's own time, added up


def test_eval_rerun_on_a_finished_file_starts_no_server(tmp_path, capsys, monkeypatch):
    from sgl_reason import cli

    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "q0", "answer": "0"}\n')
    out = tmp_path / "out.jsonl"
    run(lambda q: ProgramResult(answer="0", samples=[], cost=Cost(requests=1)),
        load(str(data)), out, progress=False)
    wall = json.loads(summary_path(out).read_text())["wall_seconds"]

    def no_server(*args):
        raise AssertionError("a finished eval started a server")

    monkeypatch.setattr("sgl_reason.connection.connect", no_server)
    assert cli.main(["eval", "--program", "think_then_answer", "--data", str(data),
                     "--out", str(out)]) == 0
    assert "nothing to run, no server started" in capsys.readouterr().err
    assert json.loads(summary_path(out).read_text())["wall_seconds"] == wall  # not reset to 0
