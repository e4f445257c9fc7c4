"""``sgl-reason model train-reasoner``: LoRA on SmolLM2-135M-Instruct over code-written traces.

What trains: LoRA (rank ``rank``) on every linear layer of the 30 blocks, and the embedding rows
of the two added marker tokens ``<think>``/``</think>`` (peft's trainable tokens; the embedding
is tied, so the same rows are the output head's). Everything else is frozen.

Deterministic for a seed on one machine: the data, their order, the initialization of the new
rows and of LoRA. Interrupted runs resume: every ``checkpoint_every`` steps the adapter,
optimizer, schedule, step and loss log go to ``out/checkpoint`` (written to a temporary folder,
then renamed); a rerun with the same config continues from there.

Loss is computed on the assistant's tokens only (thinking, marker, answer, EOS). Batches group
traces of similar length (little padding); tokens/s counts real tokens.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
import shutil
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sgl_reason.reasoner.traces import (
    MAX_SEED, THINK_END, THINK_START, Trace, family_seeds, held_out_questions, make_traces,
)

logger = logging.getLogger(__name__)

ADAPTER_FILE = "adapter_model.safetensors"


class TrainConfig(BaseModel):
    """One training run. ``counts`` traces per family, from seeds ``seed`` upward."""

    model_config = ConfigDict(extra="forbid")

    # sized from a pilot (~190 tokens/s on traces of ~370 tokens) to ~90 min on the 2-core CPU;
    # the v2 run took 70 min (938k tokens, 223 tokens/s). gsm_symbolic is only reported, so it
    # gets the fewest
    counts: dict[str, int] = {"chain_sum": 1000, "basic_arithmetic": 1150,
                              "leg_counting": 500, "gsm_symbolic": 100}
    seed: int = Field(1_000_000, ge=0, lt=MAX_SEED)
    rank: int = Field(32, ge=1)
    alpha: int = Field(64, ge=1)
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(20, ge=0)
    epochs: float = Field(1.0, gt=0)
    batch_size: int = Field(8, ge=1)
    max_len: int = Field(768, ge=64)  # longer traces are left out (counted in the stats)
    # a batch holds at most this many tokens, padding included (fewer traces when they are
    # long): 8 traces of 1,280 tokens needed more than the machine's 24 GiB (the 30 layers'
    # activations kept for backward; attention is SDPA and keeps no score matrix). 8 x 768
    # ran in the v2-v4 runs.
    max_batch_tokens: int = Field(8 * 768, ge=64)
    checkpoint_every: int = Field(50, ge=1)
    device: str = "cpu"
    # continue from an adapter folder (LoRA of the same rank and marker rows) instead of zeros
    init_adapter: str | None = None
    # loss weight of the tokens that carry a decision (digits, < >, borrow, carry, the check's
    # verdict); every other trained token weighs 1. The reported loss stays the plain mean.
    decision_weight: float = Field(1.0, ge=1.0)

    @model_validator(mode="after")
    def _seeds_miss_the_held_out_set(self) -> "TrainConfig":
        family_seeds(self.counts, self.seed)  # raises, naming the fix
        return self


def chat_prompt(question: str) -> str:
    """The prompt exactly as SGLang's ``chatml`` frontend template writes it, thinking opened."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{THINK_START}\n"


def add_marker_tokens(tokenizer) -> list[int]:
    """Add ``<think>``/``</think>`` as single, non-special tokens (kept in decoded text, as
    Qwen3's are); return their ids."""
    from tokenizers import AddedToken

    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t in (THINK_START, THINK_END)])
    return tokenizer.convert_tokens_to_ids([THINK_START, THINK_END])


# a token that carries a decision: a digit, a comparison, a borrow or carry, a check's verdict
DECISION = re.compile(r"[0-9<>]|borrow|carry|right|wrong|same|Wait")
# the sign of a digit pair (``9 and 9: 9=9``), ``=`` included: weighting only ``<`` and ``>``
# there taught v4 that a pair's sign is rarely ``=``, and 6 of its 9 wrong chain_sum traces
# wrote ``9>9`` or ``0<0``
PAIR_SIGN = re.compile(r"(-?\d) and (-?\d): -?\d([=<>])")
# the plan line names a way drawn at random (``traces.ORDER_WEIGHTS``): no way is a decision to
# get right, so its tokens weigh 1 and the model learns the drawn shares. v10 weighted the
# ``right`` of "right to left" three times over ``left`` and learned the right way 0.66 at the
# plan's first token (3 x 0.38 / (3 x 0.38 + 0.62) = 0.64) where 0.38 of its flat chains were
# drawn that way: greedy took it on every chain
PLAN = re.compile(r"^Plan:.*$", re.MULTILINE)


def _decision_chars(text: str) -> list[bool]:
    """Per character of ``text``: does it carry a decision (:data:`DECISION`,
    :data:`PAIR_SIGN`; never on the :data:`PLAN` line)."""
    marked = [False] * len(text)
    for m in DECISION.finditer(text):
        marked[m.start():m.end()] = [True] * (m.end() - m.start())
    for m in PAIR_SIGN.finditer(text):
        marked[m.start(3)] = True
    for m in PLAN.finditer(text):
        marked[m.start():m.end()] = [False] * (m.end() - m.start())
    return marked


def encode(tokenizer, trace: Trace, decision_weight: float = 1.0):
    """Token ids, labels and loss weights. Labels are -100 on the prompt and on every token that
    touches a slip's wrong value (``trace.untrained``), so the model learns to catch a slip,
    never to make one; tokens that carry a decision (:func:`_decision_chars`) weigh
    ``decision_weight``. The prompt and the completion are tokenized apart, as the server
    tokenizes a prompt and then generates."""
    prompt = tokenizer(chat_prompt(trace.question), add_special_tokens=False)["input_ids"]
    rest = trace.completion[len(THINK_START) + 1:] + "<|im_end|>"
    enc = tokenizer(rest, add_special_tokens=False, return_offsets_mapping=True)
    target = enc["input_ids"]
    labels = [-100 if any(s < b and a < e for a, b in trace.untrained) else t
              for t, (s, e) in zip(target, enc["offset_mapping"])]
    decisive = _decision_chars(rest)
    weights = [decision_weight if any(decisive[s:e]) else 1.0 for s, e in enc["offset_mapping"]]
    return prompt + target, [-100] * len(prompt) + labels, [0.0] * len(prompt) + weights


def _batches(examples, batch_size: int, rng: random.Random, max_tokens: int | None = None):
    """Shuffle, group by length in windows of 32 batches, shuffle the batches. A batch holds at
    most ``batch_size`` traces and ``max_tokens`` tokens, padding included."""
    order = list(range(len(examples)))
    rng.shuffle(order)
    window = batch_size * 32
    batches = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w:w + window], key=lambda i: len(examples[i][0]))
        batch: list[int] = []
        for i in chunk:  # ascending length: the newest trace is the batch's longest
            if batch and (len(batch) == batch_size
                          or max_tokens and (len(batch) + 1) * len(examples[i][0]) > max_tokens):
                batches.append(batch)
                batch = []
            batch.append(i)
        if batch:
            batches.append(batch)
    rng.shuffle(batches)
    return batches


def _collate(examples, idx, pad_id: int):
    import torch

    n = max(len(examples[i][0]) for i in idx)
    ids = torch.full((len(idx), n), pad_id, dtype=torch.long)
    labels = torch.full((len(idx), n), -100, dtype=torch.long)
    weights = torch.zeros((len(idx), n))
    mask = torch.zeros((len(idx), n), dtype=torch.long)
    for row, i in enumerate(idx):
        x, y, w = examples[i]
        ids[row, :len(x)] = torch.tensor(x)
        labels[row, :len(y)] = torch.tensor(y)
        weights[row, :len(w)] = torch.tensor(w)
        mask[row, :len(x)] = 1
    return ids, labels, weights, mask


def _step_losses(model, ids, mask, labels, weights, autocast, chunk: int = 1024):
    """(weighted loss to train on, plain mean cross-entropy to report), over next tokens.

    The output head and the cross-entropy run only on the positions whose next token is
    trained, ``chunk`` rows at a time, and each chunk's logits are recomputed in the backward
    pass instead of kept: the whole batch's logits (tokens x 49k vocabulary, an fp32 copy and
    the gradients of both) are never held at once. Same loss and gradients
    (``test_the_chunked_loss_matches_the_loss_over_full_logits``); what it saves is measured by
    ``experiments/train_step_memory.py``."""
    import torch
    from torch.utils.checkpoint import checkpoint

    inner = model.get_base_model()  # LoRA and the marker rows are patched into its modules
    with autocast:
        hidden = inner.model(input_ids=ids, attention_mask=mask).last_hidden_state
    targets, weights = labels[:, 1:], weights[:, 1:]
    trained = targets != -100
    rows, targets, weights = hidden[:, :-1][trained], targets[trained], weights[trained]
    head = inner.get_output_embeddings()

    def chunk_ce(h, y):
        with autocast:
            logits = head(h)
        return torch.nn.functional.cross_entropy(logits.float(), y, reduction="none")

    ce = torch.cat([checkpoint(chunk_ce, rows[s:s + chunk], targets[s:s + chunk],
                               use_reentrant=False)
                    for s in range(0, len(rows), chunk)])
    return (ce * weights).sum() / weights.sum(), ce.mean()


def build_model(base: Path, config: TrainConfig):
    """Base model with the marker tokens added and the LoRA adapter attached (untrained)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    marker_ids = add_marker_tokens(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    emb = model.get_input_embeddings().weight
    with torch.no_grad():  # a new row starts as the mean of the rows of its spelling
        for text, i in zip((THINK_START, THINK_END), marker_ids):
            pieces = tokenizer(text.replace("<", "< ").split(" ", 1)[1], add_special_tokens=False)
            emb[i] = emb[pieces["input_ids"]].mean(0)
    lora = LoraConfig(
        r=config.rank, lora_alpha=config.alpha, lora_dropout=0.0, bias="none",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        trainable_token_indices={"embed_tokens": marker_ids}, task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    if config.init_adapter:
        load_adapter(model, Path(config.init_adapter))
    return tokenizer, model, marker_ids


def load_adapter(model, folder: Path) -> None:
    """Continue from a trained adapter: every LoRA and marker-row weight must match."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = folder / ADAPTER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"--init-adapter: {path} is missing; pass the folder that holds "
                                f"{ADAPTER_FILE} (sgl_reason/reasoner/adapter for the shipped one)")
    weights = {k: v.float() for k, v in load_file(path).items()}
    result = set_peft_model_state_dict(model, weights)
    if result.unexpected_keys:
        raise ValueError(f"{path} does not fit this model (rank or modules differ): "
                         f"unexpected {result.unexpected_keys[:3]}")


def train(base: Path, out: Path, config: TrainConfig, *, progress: bool = True,
          max_steps: int | None = None) -> dict | None:
    """Train (or resume) and write the adapter, loss curve and stats to ``out``.

    ``max_steps``: stop (checkpointed) after that many steps of this call and return None; a
    later call resumes."""
    import torch
    from tqdm import tqdm

    torch.manual_seed(config.seed)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.json").write_text(config.model_dump_json(indent=2))
    tokenizer, model, marker_ids = build_model(base, config)
    model.to(config.device)

    traces = make_traces(config.counts, config.seed, exclude=held_out_questions())
    encoded = [encode(tokenizer, t, config.decision_weight) for t in traces]
    examples = [e for e in encoded if len(e[0]) <= config.max_len]
    rng = random.Random(config.seed)
    batches = []
    for _ in range(math.ceil(config.epochs)):
        batches += _batches(examples, config.batch_size, rng, config.max_batch_tokens)
    batches = batches[:max(1, round(len(batches) * config.epochs / math.ceil(config.epochs)))]
    total_steps = len(batches)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)

    def lr_at(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        done = (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    log: list[dict] = []
    step, seconds, tokens = 0, 0.0, 0
    ckpt = out / "checkpoint"
    if (ckpt / "state.pt").is_file():
        state = torch.load(ckpt / "state.pt", weights_only=False)
        model.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        step, seconds, tokens, log = state["step"], state["seconds"], state["tokens"], state["log"]
        logger.info("resuming at step %d of %d", step, total_steps)

    autocast = torch.autocast(torch.device(config.device).type, dtype=torch.bfloat16)
    model.train()
    bar = tqdm(total=total_steps, initial=step, disable=not progress, desc="train-reasoner",
               unit="step")
    stop_at = total_steps if max_steps is None else min(total_steps, step + max_steps)
    while step < stop_at:
        start = time.perf_counter()
        ids, labels, weights, mask = (t.to(config.device) for t in
                                      _collate(examples, batches[step], tokenizer.pad_token_id or 0))
        weighted, loss = _step_losses(model, ids, mask, labels, weights, autocast)
        weighted.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        loss = loss.item()
        seconds += time.perf_counter() - start
        tokens += int(mask.sum())
        log.append({"step": step, "loss": loss, "tokens": tokens, "seconds": seconds})
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens / seconds:.0f}")
        bar.update(1)
        if step % config.checkpoint_every == 0 or step == stop_at:
            _checkpoint(ckpt, model, optimizer, schedule, step, seconds, tokens, log)
    bar.close()
    if step < total_steps:
        return None

    stats = {
        "steps": total_steps, "examples": len(examples), "left_out_longer": len(encoded) - len(examples),
        "tokens_trained": tokens, "train_seconds": round(seconds, 1),
        "tokens_per_second": round(tokens / seconds, 1) if seconds else None,
        "final_loss": sum(r["loss"] for r in log[-20:]) / min(20, len(log)),
        "slipped_traces": sum(t.slipped for t in traces),
        "families": {f: sum(t.family == f for t in traces) for f in config.counts},
        "marker_ids": marker_ids, "config": config.model_dump(),
    }
    save_adapter(model, tokenizer, out)
    (out / "train_stats.json").write_text(json.dumps(stats, indent=2))
    (out / "loss.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    plot_loss(log, out / "loss.png")
    return stats


def _checkpoint(ckpt: Path, model, optimizer, schedule, step, seconds, tokens, log) -> None:
    import torch

    trainable = {k: v for k, v in model.state_dict().items()
                 if "lora_" in k or "trainable_tokens" in k}
    staging = ckpt.with_name(ckpt.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    torch.save({"model": trainable, "optimizer": optimizer.state_dict(),
                "schedule": schedule.state_dict(), "step": step, "seconds": seconds,
                "tokens": tokens, "log": log}, staging / "state.pt")
    shutil.rmtree(ckpt, ignore_errors=True)
    staging.rename(ckpt)


def save_adapter(model, tokenizer, out: Path) -> None:
    """The adapter in bf16 (half the bytes; merged into a bf16 model anyway) and the tokenizer
    with its marker tokens."""
    import torch
    from safetensors.torch import load_file, save_file

    adapter = out / "adapter"
    model.save_pretrained(adapter, save_embedding_layers=False)
    weights = load_file(adapter / ADAPTER_FILE)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()},
              adapter / ADAPTER_FILE)
    tokenizer.save_pretrained(adapter)


def plot_loss(log: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in log]
    losses = [r["loss"] for r in log]
    k = 20
    smooth = [sum(losses[max(0, i - k + 1):i + 1]) / len(losses[max(0, i - k + 1):i + 1])
              for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, losses, alpha=0.3, label="loss")
    ax.plot(steps, smooth, label=f"mean of last {k}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (assistant tokens)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
