"""`sgl-reason eval` and `sgl-reason plot`: errors that name the fix, and a real run."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from sgl_reason.cli import main


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "sgl_reason", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_unknown_program_lists_the_choices(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--program", "tree_of_thought", "--data", "x.jsonl"])
    assert "invalid choice: 'tree_of_thought'" in capsys.readouterr().err


def test_bad_data_names_the_file_and_line(tmp_path, capsys):
    assert main(["eval", "--program", "self_consistency", "--data", str(tmp_path / "no.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "1"}\n{"prompt": "q", "answer": "1"}\n')
    assert main(["eval", "--program", "self_consistency", "--data", str(bad)]) == 2
    assert "bad.jsonl:2: the record has no 'question' field" in capsys.readouterr().err


def test_an_unknown_model_name_lists_the_known_ones(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["model", "prepare", "--model", "qwen-9000"])
    assert "unknown model 'qwen-9000'; known models: reasoner, smollm2" in capsys.readouterr().err
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "q", "answer": "1"}\n')
    assert main(["eval", "--program", "think_then_answer", "--data", str(data),
                 "--model", "qwen-9000"]) == 2
    assert "not a known model name (reasoner, smollm2)" in capsys.readouterr().err


def test_bad_training_counts_name_the_families():
    """Checked before any model is loaded: a typo must not cost a training run."""
    with pytest.raises(SystemExit, match="FAMILY=N with FAMILY one of chain_sum, basic_arithmetic"):
        main(["model", "train-reasoner", "--counts", "chain_sums=10"])
    with pytest.raises(SystemExit, match="'leg_counting=many'"):
        main(["model", "train-reasoner", "--counts", "chain_sum=10,leg_counting=many"])


def test_a_training_seed_that_reaches_the_held_out_seeds_is_refused(tmp_path, capsys):
    """Checked before any model is loaded, with the fix named."""
    assert main(["model", "train-reasoner", "--out", str(tmp_path / "run"), "--seed", "4900000",
                 "--counts", "chain_sum=10,gsm_symbolic=10"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sgl-reason: error: gsm_symbolic's training seeds 5,000,000..5,000,009")
    assert "pass a --seed" in err and not (tmp_path / "run").exists()


def test_bad_thinking_tier(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--program", "think_then_answer", "--data", "x", "--max-thinking-tokens", "lots"])
    assert "expected an integer or one of ['high', 'low', 'medium']" in capsys.readouterr().err


def test_unreachable_url_fails_fast(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n')
    started = time.monotonic()
    result = cli("eval", "--program", "self_consistency", "--data", str(data), "--url",
                 "http://127.0.0.1:9", timeout=120)
    assert result.returncode != 0
    assert "no SGLang server answers at http://127.0.0.1:9" in result.stderr
    assert time.monotonic() - started < 60


@pytest.mark.server
def test_eval_then_plot(runtime, tmp_path):
    out = tmp_path / "sc.jsonl"
    result = cli("eval", "--program", "self_consistency", "--data",
                 "reasoning-gym:basic_arithmetic?size=3&seed=0", "--n", "2", "--max-tokens", "16",
                 "--url", runtime.url, "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "extraction rate" in result.stdout
    # a server at --url: the summary names the model it serves, not the embedded default
    served = json.loads(out.with_name("sc.summary.json").read_text())["run"]["model"]
    assert served == runtime.endpoint.server_info["model_path"], served
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 3 and {"question", "gold", "prediction", "correct", "samples", "cost"} <= records[0].keys()
    # resumable: a second run does no new work
    again = cli("eval", "--program", "self_consistency", "--data",
                "reasoning-gym:basic_arithmetic?size=3&seed=0", "--url", runtime.url, "--out", str(out))
    assert again.returncode == 0 and len(out.read_text().splitlines()) == 3
    summary = json.loads(out.with_name("sc.summary.json").read_text())
    assert summary["run"]["program"] == "self_consistency" and summary["run"]["n"] == 2
    from sgl_reason.plot import point_label

    assert point_label("sc", summary) == (
        "self_consistency n=2 reasoning-gym:basic_arithmetic?size=3&seed=0 (3 problems)")

    bench = tmp_path / "ps.json"
    bench.write_text(json.dumps({"n": 8, "prompt_tokens": 10, **{
        k: {"computed_prefill_tokens": 10, "seconds": 1.0} for k in ("single", "naive", "shared")}}))
    plots = cli("plot", str(out), str(bench), "--out", str(tmp_path / "plots"))
    assert plots.returncode == 0, plots.stderr
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["accuracy_vs_tokens.png", "bench_ps.png", "tokens_per_problem.png"]


def test_plot_rejects_unknown_files(tmp_path, capsys):
    other = tmp_path / "x.json"
    other.write_text("{}")
    assert main(["plot", str(other)]) == 2
    assert "not an eval records/summary file" in capsys.readouterr().err


def test_bad_thinking_kv_shape(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "thinking-kv", "--shape", "32,256"])
    assert "--shape takes P,T,A (three integers), got '32,256'" in capsys.readouterr().err


def test_unknown_thinking_kv_problem_rows_name_the_valid_ones():
    with pytest.raises(SystemExit, match="unknown rows \\['scored-7%'\\]: choose from keep, "
                                         "keep_repeat, release-on-answer"):
        main(["bench", "thinking-kv", "--workload", "problems", "--rows", "scored-7%"])


def test_plot_of_a_thinking_kv_report(tmp_path):
    row = {"mean_running": 2.0, "answer_nll": 0.1}
    report = tmp_path / "tkv.json"
    report.write_text(json.dumps({
        "policies": {"keep": row, "release-on-answer": {**row, "mean_running": 3.0}},
        "ideal_gain": 1.66, "max_total_tokens": 1400, "concurrency_gain_release_vs_keep": 1.5}))
    assert main(["plot", str(report), "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "bench_tkv.png").stat().st_size > 0


def test_bad_bench_rows(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "early-stop", "--rows", "probe,vibes"])
    assert "unknown bench row(s) vibes: choose from half_budget" in capsys.readouterr().err


def test_bad_early_stop_names_the_choices(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n')
    assert main(["eval", "--program", "think_then_answer", "--data", str(data),
                 "--early-stop", "vibes"]) == 2
    assert "Supported signals" in capsys.readouterr().err
    assert main(["eval", "--program", "best_of_n", "--data", str(data), "--early-stop",
                 "entropy", "--url", "http://127.0.0.1:9"]) == 2
    assert "not best_of_n" in capsys.readouterr().err
    base = ["eval", "--program", "think_then_answer", "--data", str(data)]
    assert main([*base, "--verifier", "arithmetic"]) == 2
    assert "use --program best_of_n" in capsys.readouterr().err
    assert main([*base, "--vote-weights", "confidence"]) == 2
    assert "weighs self_consistency's vote" in capsys.readouterr().err
    assert main([*base, "--min-p", "0.1"]) == 2
    assert "needs --temperature" in capsys.readouterr().err
    assert main([*base, "--temperature", "0.7", "--min-p", "1.5"]) == 2
    assert "from 0 to 1" in capsys.readouterr().err
    assert main([*base, "--early-stop", "probe", "--early-stop-option", "probe_confidence=1.5"]) == 2
    assert "probe_confidence" in capsys.readouterr().err
    assert main([*base, "--early-stop", "probe", "--early-stop-option", "probe_confidence"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
    assert main([*base, "--early-stop-option", "probe_confidence=0.4"]) == 2
    assert "needs --early-stop" in capsys.readouterr().err
    # a misspelled key names the one it resembles and lists the valid ones
    assert main([*base, "--early-stop", "probe", "--early-stop-option", "probe_confidense=0.4"]) == 2
    err = capsys.readouterr().err
    assert "'probe_confidense' is not an option. Did you mean probe_confidence?" in err
    assert "probe_tokens" in err and "Extra inputs" not in err


@pytest.mark.server
def test_sigterm_aborts_an_evals_problems_in_flight_and_stops_its_server(tmp_path):
    """A killed `sgl-reason eval` aborts the requests it has in flight (it does not wait for
    their last token) and leaves no embedded server running."""
    import os
    import re
    import signal

    import psutil
    import requests

    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n' * 50)
    log = tmp_path / "err.log"
    with open(log, "w") as err:
        # SmolLM2 never closes its thinking: each problem thinks 2,048 tokens
        proc = subprocess.Popen([sys.executable, "-m", "sgl_reason", "eval", "--program",
                                 "think_then_answer", "--max-thinking-tokens", "2048",
                                 "--data", str(data),
                                 "--out", str(tmp_path / "o.jsonl")], stdout=subprocess.DEVNULL,
                                stderr=err)
    children = []
    try:
        deadline, url, running = time.monotonic() + 240, None, 0
        while time.monotonic() < deadline and not running:
            time.sleep(0.5)
            url = url or next(iter(re.findall(r"server at (http://\S+)", log.read_text())), None)
            if url:  # the server is up: wait until the eval's first problems decode
                loads = requests.get(url + "/v1/loads", timeout=10).json()["loads"][0]
                running = loads["num_running_reqs"]
        assert running, f"no request ever ran:\n{log.read_text()[-2000:]}"
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 130
        _, alive = psutil.wait_procs(children, timeout=60)
        assert alive == []
        text = log.read_text()
        # 2 problems in flight, 2,048 thinking tokens each: aborted, not waited for
        aborted = re.findall(r"aborted (\d+) requests in flight", text)
        assert aborted and int(aborted[0]) >= 1, text[-2000:]
        assert "eval interrupted" in text and not (tmp_path / "o.jsonl").read_text()
    finally:  # a failed run leaves nothing either
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        for child in children:
            if child.is_running():
                child.kill()
