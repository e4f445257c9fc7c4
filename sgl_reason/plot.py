"""``sgl-reason plot RESULTS...``: PNG charts from eval records/summaries and benchmark JSON.

Recognized inputs (by content, not name):

- eval records (``OUT.jsonl``): tokens per problem, one box per file;
- eval summaries (``OUT.summary.json``, or found beside a records file): accuracy vs tokens;
- ``bench prefix-sharing`` JSON (has ``single``/``naive``/``shared``): side-by-side bars.
"""

from __future__ import annotations

import json
from pathlib import Path


def _load(path: Path):
    if path.suffix == ".jsonl":
        return "records", [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    data = json.loads(path.read_text())
    if {"single", "naive", "shared"} <= data.keys():
        return "prefix_sharing", data
    if {"accuracy", "tokens_per_problem"} <= data.keys():
        return "summary", data
    if {"policies", "ideal_gain"} <= data.keys():
        return "thinking_kv", data
    raise ValueError(f"{path}: not an eval records/summary file nor a known benchmark JSON")


def plot(paths: list[str], out_dir: str = "plots") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sgl_reason.evaluate import summary_path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records, summaries, benches, written = {}, {}, {}, []
    for name in paths:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        kind, data = _load(path)
        label = path.name.removesuffix(".summary.json").removesuffix(".jsonl").removesuffix(".json")
        if kind == "records":
            records[label] = data
            beside = summary_path(path)
            if beside.is_file():
                summaries.setdefault(label, json.loads(beside.read_text()))
        elif kind == "summary":
            summaries[label] = data
        elif kind == "thinking_kv":
            written.append(_thinking_kv(plt, data, out / f"bench_{label}.png"))
        else:
            benches[label] = data
    if summaries:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        x_max = max(s["tokens_per_problem"] for s in summaries.values()) * 1.15 + 1
        for label, s in summaries.items():
            x = s["tokens_per_problem"]
            ax.scatter(x, s["accuracy"])
            # a label reads rightwards from its point, or leftwards in the right half of the
            # axis, so that the last point's label stays inside the figure
            left = x > x_max / 2
            ax.annotate(point_label(label, s), (x, s["accuracy"]), xytext=(-4 if left else 4, 4),
                        textcoords="offset points", fontsize=7, ha="right" if left else "left")
        ax.set_xlim(0, x_max)
        ax.set_ylim(0, 1.05)  # accuracy is a share: a 0-1 axis, never a zoom on noise
        ax.set(xlabel="decoded tokens per problem", ylabel="accuracy", title="Accuracy vs tokens")
        written.append(_save(fig, out / "accuracy_vs_tokens.png"))
    if records:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.boxplot([[r["cost"]["decode_tokens"] for r in rs] for rs in records.values()])
        ax.set_xticks(range(1, len(records) + 1), list(records), rotation=20, fontsize=8)
        ax.set(ylabel="decoded tokens", title="Tokens per problem")
        written.append(_save(fig, out / "tokens_per_problem.png"))
    for label, b in benches.items():
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        rows = ["single", "naive", "shared"]
        for ax, key, title in ((axes[0], "computed_prefill_tokens", "prefill computed (tokens)"),
                               (axes[1], "seconds", "wall time (s)")):
            ax.bar(rows, [b[r][key] for r in rows], color=["#999", "#c55", "#5a5"])
            ax.set_title(title)
        fig.suptitle(f"{label}: n={b['n']}, prompt {b['prompt_tokens']} tokens")
        written.append(_save(fig, out / f"bench_{label}.png"))
    return written


def point_label(label: str, summary: dict) -> str:
    """What a summary's point stands for: program, n, budget, data, and its sample count."""
    run = summary.get("run") or {}
    parts = [run.get("program") or label]
    if run.get("n"):
        parts.append(f"n={run['n']}")
    if run.get("budget"):
        parts.append(f"budget {run['budget']}")
    if run.get("early_stop"):
        parts.append(f"stop: {run['early_stop']}")
    if run.get("data"):
        parts.append(Path(str(run["data"])).name)
    return " ".join(parts) + f" ({summary['problems']} problems)"


def _thinking_kv(plt, b: dict, path: Path) -> Path:
    """Per policy row: concurrency the pool supports, and the answers' NLL (quality cost)."""
    rows = list(b["policies"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, key, title in ((axes[0], "mean_running", "mean running requests"),
                           (axes[1], "answer_nll", "answer-token NLL")):
        ax.bar(rows, [b["policies"][r][key] or 0 for r in rows])
        ax.set_title(title)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.suptitle(f"thinking KV at {b['max_total_tokens']} tokens: release vs keep "
                 f"{b['concurrency_gain_release_vs_keep']}x (ideal {b['ideal_gain']}x)")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
