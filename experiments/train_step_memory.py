"""Which blocks make a training step slow? (issue #16, session 30)

Runs ``--steps`` training steps on v8's data and seed (``--scale`` of its traces, batched as
``train-reasoner`` batches them, the largest batches first) in this process, in one of two loss
modes, and prints per step: seconds, minor page faults, system-time share, and the process's
peak resident size so far.

    HF_HUB_OFFLINE=1 .venv/bin/python experiments/train_step_memory.py --loss full
    HF_HUB_OFFLINE=1 .venv/bin/python experiments/train_step_memory.py --loss chunked

``full`` is the loss as trained through v8 (the model's logits for every position, then an fp32
copy); ``chunked`` is ``train._step_losses`` (the head only on trained positions, chunk by chunk,
recomputed in backward). ``--top`` adds ``torch.profiler``'s largest allocating operators of one
step. Run one mode per process: the peak resident size only rises.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import time

import torch
import torch.nn.functional as F

from sgl_reason import model as models
from sgl_reason.reasoner.traces import held_out_questions, make_traces
from sgl_reason.reasoner.train import (
    TrainConfig, _batches, _collate, _step_losses, build_model, encode,
)

V8 = {"chain_sum": 1200, "basic_arithmetic": 2200, "leg_counting": 900, "gsm_symbolic": 60}


def full_losses(model, ids, mask, labels, weights, autocast):
    with autocast:
        logits = model(input_ids=ids, attention_mask=mask).logits
    logits, labels, weights = logits[:, :-1].float(), labels[:, 1:], weights[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                         ignore_index=-100, reduction="none").view_as(labels)
    trained = labels != -100
    weights = weights * trained
    return (ce * weights).sum() / weights.sum(), ce[trained].mean()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loss", choices=["full", "chunked"], required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--scale", type=float, default=0.05, help="fraction of v8's traces to make")
    ap.add_argument("--top", action="store_true")
    args = ap.parse_args()

    config = TrainConfig(counts=V8, seed=4_800_000, decision_weight=3, max_len=1280)
    tokenizer, model, _ = build_model(models.default_model_path(), config)
    counts = {f: max(1, math.ceil(n * args.scale)) for f, n in config.counts.items()}
    traces = make_traces(counts, config.seed, exclude=held_out_questions())
    examples = [e for e in (encode(tokenizer, t, config.decision_weight) for t in traces)
                if len(e[0]) <= config.max_len]
    batches = _batches(examples, config.batch_size, random.Random(config.seed),
                       config.max_batch_tokens)
    # the largest batches first: they set the step's peak
    batches.sort(key=lambda b: -len(b) * max(len(examples[i][0]) for i in b))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    model.train()
    for step in range(args.steps):
        ids, labels, weights, mask = _collate(examples, batches[step], tokenizer.pad_token_id)
        before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        prof = torch.profiler.profile(profile_memory=True) if args.top and step == 1 else None
        if prof:
            prof.__enter__()
        if args.loss == "full":
            weighted, loss = full_losses(model, ids, mask, labels, weights, autocast)
        else:
            weighted, loss = _step_losses(model, ids, mask, labels, weights, autocast)
        weighted.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if prof:
            prof.__exit__(None, None, None)
        after, seconds = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        print(json.dumps({
            "loss_mode": args.loss, "step": step, "shape": list(ids.shape),
            "tokens": int(mask.sum()), "loss": round(loss.item(), 4),
            "seconds": round(seconds, 2), "minor_faults": after.ru_minflt - before.ru_minflt,
            "system_share": round((after.ru_stime - before.ru_stime) / cpu, 2),
            "peak_rss_gb": round(after.ru_maxrss / 2**20, 2),
        }), flush=True)
        if prof:
            print(prof.key_averages().table(sort_by="self_cpu_memory_usage", row_limit=15))


if __name__ == "__main__":
    main()
