"""Which dtype to store the default model in: decode speed and greedy agreement, bf16 vs fp32.

    .venv/bin/python benchmarks/model_dtype.py [--json results/model_dtype.json]

Prepares both folders (cached), serves each on the embedded CPU server in turn, and measures
decode tokens/s at batch 1 and batch 8 plus greedy-text agreement with fp32 over a few prompts.
"""

from __future__ import annotations

import argparse
import json
import time

from sgl_reason import EmbeddedRuntime, model

PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain why the sky is blue.",
    "List three uses of a paperclip.",
    "What is 17 + 25? Think step by step.",
]


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def measure(dtype: str) -> dict:
    path = model.prepare(dtype=dtype)
    with EmbeddedRuntime(model=path) as rt:
        rt.generate(chat(PROMPTS[0]), max_new_tokens=8, temperature=0)  # warm
        t = time.perf_counter()
        rt.generate(chat(PROMPTS[0]), max_new_tokens=128, temperature=0, ignore_eos=True)
        b1 = 128 / (time.perf_counter() - t)
        t = time.perf_counter()
        rt.generate([chat(p) + str(i) for i, p in enumerate(PROMPTS * 2)], max_new_tokens=64,
                    temperature=0, ignore_eos=True)
        b8 = 8 * 64 / (time.perf_counter() - t)
        greedy = [rt.generate(chat(p), max_new_tokens=48, temperature=0)["text"] for p in PROMPTS]
    return {"decode_tok_s_batch1": round(b1, 1), "decode_tok_s_batch8": round(b8, 1),
            "greedy": greedy}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = {dtype: measure(dtype) for dtype in ("bfloat16", "float32")}
    ref = rows["float32"]["greedy"]
    for row in rows.values():
        row["greedy_agreement_vs_fp32"] = sum(a == b for a, b in zip(row.pop("greedy"), ref)) / len(ref)
    print(json.dumps(rows, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
