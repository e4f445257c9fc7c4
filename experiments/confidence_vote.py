"""Replay a confidence-weighted vote on a self-consistency run's recorded samples.

    .venv/bin/python experiments/confidence_vote.py SC_RECORDS.jsonl DATA.jsonl MODEL_DIR \
        [GREEDY_RECORDS.jsonl] [--temperature 0.7] [--out SCORES.jsonl]

Each sample's text (thinking, marker, answer) is scored by one teacher-forced forward pass of
MODEL_DIR (the merged folder that drew it) after the reasoner's prompt. Per generated token:
confidence = minus the mean of the top-5 logprobs of softmax(logits / temperature), the
distribution SGLang returns logprobs from at that temperature. Per sample: its lowest mean
over a sliding group of 32 tokens, exactly ``EarlyStop(signal="confidence")``'s weight
(``trace_confidence``; top_k 5, window 32). The rule replayed, fixed before
the run (lab notes, experiments/README.md): every sample kept, each votes with that weight;
the answer with the largest summed weight wins. Printed beside the plain vote, one sample
and greedy, per family.

A replay, not the server: the text is retokenized, so a token the server split otherwise is
scored as the tokenizer splits it now.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from sgl_reason.data import load
from sgl_reason.early_stop.confidence import CONFIDENCE_TOP_K, trace_confidence
from sgl_reason.reasoner.train import chat_prompt
from sgl_reason.vote import normalize_answer, vote


@torch.inference_mode()
def score(model, tok, question: str, texts: list[str], temperature: float) -> list[float]:
    prompt = tok(chat_prompt(question), add_special_tokens=False)["input_ids"]
    weights = []
    for text in texts:
        ids = prompt + tok(text, add_special_tokens=False)["input_ids"]
        logits = model(torch.tensor([ids])).logits[0, len(prompt) - 1:-1].float()
        top = torch.log_softmax(logits / temperature, -1).topk(CONFIDENCE_TOP_K, -1).values
        weights.append(trace_confidence(top.tolist()))
    return weights


def weighted(answers: list[str | None], weights: list[float]) -> str | None:
    total: dict[str, float] = defaultdict(float)
    for a, w in zip(answers, weights):
        if a:
            total[normalize_answer(a)] += w
    return max(total, key=total.get) if total else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sc"), ap.add_argument("data"), ap.add_argument("model")
    ap.add_argument("greedy", nargs="?")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--out")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
    torch.set_num_threads(2)
    problems = {p.id: p for p in load(args.data)}
    greedy = {}
    if args.greedy:
        greedy = {r["question"]: r["correct"] for r in map(json.loads, open(args.greedy))}
    rows = defaultdict(lambda: defaultdict(list))
    out = open(args.out, "w") if args.out else None
    for rec in map(json.loads, open(args.sc)):
        p = problems.get(rec["id"])
        if p is None or p.question != rec["question"]:
            continue
        samples = rec["samples"]
        w = score(model, tok, p.question, [x["text"] for x in samples], args.temperature)
        answers = [x["answer"] for x in samples]
        right = [bool(a) and p.grade(a) for a in answers]
        pick = weighted(answers, w)
        r = rows[rec["family"]]
        r["one"].append(sum(right) / len(right))
        r["vote"].append(bool(vote(answers).answer) and p.grade(vote(answers).answer))
        r["weighted"].append(bool(pick) and p.grade(pick))
        if greedy:
            r["greedy"].append(greedy[p.question])
        if out:
            out.write(json.dumps({"id": rec["id"], "weights": w, "right": right}) + "\n")
            out.flush()
    every = defaultdict(list)
    print("| family | problems | one sample | vote | weighted vote | greedy |")
    print("|---|---|---|---|---|---|")
    for fam in sorted(rows) + ["all"]:
        r = every if fam == "all" else rows[fam]
        if fam != "all":
            for k, v in r.items():
                every[k] += v
        mean = {k: sum(v) / len(v) for k, v in r.items()}
        print(f"| {fam} | {len(r['one'])} | {mean['one']:.3f} | {mean['vote']:.3f} | "
              f"{mean['weighted']:.3f} | {mean.get('greedy', float('nan')):.3f} |")
    print(json.dumps({k: sum(v) / len(v) for k, v in every.items()}))


if __name__ == "__main__":
    main()
