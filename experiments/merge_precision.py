"""Does merging the reasoner's LoRA into bf16 weights cost it accuracy? (issue #16; session 23)

    HF_HUB_OFFLINE=1 .venv/bin/python experiments/merge_precision.py [PER_FAMILY]

Training computed ``x @ bf16(W) + x @ bf16(A) @ bf16(B)`` on fp32 weights; the shipped folder
stores ``bf16(W + BA)``, which rounds the small LoRA delta to bf16's step at W's magnitude.
This teacher-forces the code-written traces (slip-free ones) of held-out chain_sum and
basic_arithmetic questions through the bf16-merged folder that ships and an fp32-merged one
(``_merge_adapter(..., "float32")`` into a temporary folder) and counts, per model: NLL per
trained token, top-1 errors on decision tokens (digits, signs, borrow, carry, verdicts), and
traces whose every token is top-1 (a trace greedy decoding would copy).
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sgl_reason.model import ADAPTER_DIR, REASONER, SMOLLM2, _merge_adapter, model_path
from sgl_reason.reasoner.traces import HELD_OUT_SEED, dataset, trace_for
from sgl_reason.reasoner.train import DECISION, encode


def measure(model, tokenizer, traces) -> dict:
    nll = tokens = decisions = decision_errors = 0
    perfect: dict[str, list[bool]] = {}
    for trace in traces:
        ids, labels, _ = encode(tokenizer, trace)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        target = torch.tensor(labels[1:])
        keep = target != -100
        logprobs = torch.log_softmax(logits[keep], -1)
        target = target[keep]
        nll -= logprobs.gather(1, target[:, None]).sum().item()
        tokens += len(target)
        wrong = logprobs.argmax(-1) != target
        decision = torch.tensor([bool(DECISION.search(t))
                                 for t in tokenizer.convert_ids_to_tokens(target.tolist())])
        decisions += int(decision.sum())
        decision_errors += int((wrong & decision).sum())
        perfect.setdefault(trace.family, []).append(not bool(wrong.any()))
    return {"nll_per_token": round(nll / tokens, 5),
            "decision_errors": f"{decision_errors} of {decisions}",
            **{f"all_top1_{f}": f"{sum(v)} of {len(v)}" for f, v in perfect.items()}}


def main(per_family: int = 50) -> None:
    torch.set_num_threads(2)
    rng = random.Random(0)
    traces = [t for family in ("chain_sum", "basic_arithmetic")
              for t in (trace_for(family, e, rng) for e in dataset(family, per_family,
                                                                   HELD_OUT_SEED))
              if not t.slipped and not t.check_slipped]
    shipped = model_path(REASONER)
    tokenizer = AutoTokenizer.from_pretrained(shipped)
    with tempfile.TemporaryDirectory() as tmp:
        fp32 = Path(tmp) / "reasoner-fp32"
        _merge_adapter(model_path(SMOLLM2), ADAPTER_DIR, fp32, "float32")
        for name, folder, dtype in (("bf16 merged (ships)", shipped, torch.bfloat16),
                                    ("fp32 merged", fp32, torch.float32)):
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
            print(name, measure(model, tokenizer, traces), flush=True)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
