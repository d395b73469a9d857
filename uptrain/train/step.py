"""One optimizer step and one evaluation. The losses are sums over a batch's target tokens
(cross-entropy, and under distillation the KL to the teacher), divided by the target tokens of
the whole step across micro-batches and processes (not averaged per micro-batch)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from uptrain.data.document_mask import DocumentPacking
from uptrain.data.objective_batches import target_counts
from uptrain.objectives import IGNORE_INDEX
from uptrain.train import metrics as M
from uptrain.train.optimizer import lr_at
from uptrain.train.setup import Run


def _logits_and_labels(model: torch.nn.Module, batch: dict[str, torch.Tensor], packing: DocumentPacking | None):
    """A batch's logits and the labels they are scored on. Causal: each position predicts the
    next token (under document_mask, within its document). Seq2seq: the decoder's logits for
    `labels`, which the model shifts right into its decoder inputs itself (-100 marks padding,
    skipped by the loss)."""
    if "labels" not in batch:
        input_ids = batch["input_ids"]
        inputs = packing.inputs(input_ids) if packing is not None else {"input_ids": input_ids}
        logits = model(**inputs, use_cache=False).logits.view(*input_ids.shape, -1)[:, :-1].float()
        return logits, input_ids[:, 1:]
    return model(**batch, use_cache=False).logits.float(), batch["labels"]


def _token_loss_sums(
    run: Run, batch: dict[str, torch.Tensor], row_weight: torch.Tensor | None = None, distill: bool = False
) -> dict[str, torch.Tensor]:
    """Summed (not averaged) losses of a batch's target tokens, so that the caller can divide by
    the number of target tokens of the whole step across micro-batches and processes."""
    logits, labels = _logits_and_labels(run.model, batch, run.packing)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    ce = ce.view(labels.shape).sum(dim=1)
    if row_weight is not None:
        ce = ce * row_weight
    sums = {"ce": ce.sum()}
    if distill and run.teacher is not None:
        config = run.plan.config
        t = config.distill_temperature
        with torch.no_grad(), run.accelerator.autocast():
            teacher_logits = _logits_and_labels(run.teacher, batch, run.packing)[0]
        # KL(teacher ‖ student) = Σ p_t (log p_t − log p_s), scaled by T² so its gradient keeps the
        # magnitude of the CE term whatever the temperature (Hinton et al. 2015).
        student_lp, teacher_lp = F.log_softmax(logits / t, dim=-1), F.log_softmax(teacher_logits / t, dim=-1)
        if "labels" in batch:  # over the scored positions only, not the padding
            pointwise = F.kl_div(student_lp, teacher_lp, log_target=True, reduction="none").sum(dim=-1)
            kl = (pointwise * (labels != IGNORE_INDEX)).sum() * t * t
        else:
            kl = F.kl_div(student_lp, teacher_lp, log_target=True, reduction="sum") * t * t
        w = config.distill_weight
        sums["kl"] = kl
        sums["loss"] = (1 - w) * sums["ce"] + w * kl
    else:
        sums["loss"] = sums["ce"]
    return sums


def evaluate(run: Run) -> dict:
    """Mean cross-entropy per target token over the eval batches (the same batches every time)."""
    acc = run.accelerator
    run.model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=acc.device)
    with torch.no_grad():
        for batch, counted in run.eval_set:
            targets = (target_counts(batch) * counted).sum().to(acc.device)
            batch, counted = _on(batch, acc.device), counted.to(acc.device)
            ce = _token_loss_sums(run, batch, row_weight=counted.float())["ce"]
            total += torch.stack([ce.double(), targets.double()])
    run.model.train()
    total = acc.reduce(total, reduction="sum")
    loss = (total[0] / total[1]).item()
    return {"eval/loss": loss, "eval/perplexity": M.perplexity(loss)}


def _on(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def train_step(run: Run, step: int) -> dict:
    """One optimizer step (`step` counted from 0). Returns the step's metrics and `tokens`, the
    target tokens its loss read on all processes (padding not counted); does not update the weights
    if the loss or gradient norm is not finite."""
    acc, config = run.accelerator, run.plan.config
    lr = lr_at(config, step, run.plan.total_steps)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    rank, rows = acc.process_index, config.batch_size
    micro = [
        # Micro-batch m's first row in the global batch, as TrainBlocks lays them out: corruption
        # is drawn per row of the global batch, whatever the split between processes.
        run.objective.train_batch(blocks, step, (m * acc.num_processes + rank) * rows)
        for m, blocks in enumerate(run.train_blocks.micro_batches(step, rank))
    ]
    local_tokens = sum(int(target_counts(b).sum()) for b in micro)
    step_tokens = acc.reduce(torch.tensor(float(local_tokens), dtype=torch.float64, device=acc.device), reduction="sum")
    # Each process's loss is a sum over its tokens divided by the step's tokens on all processes;
    # DDP averages gradients over processes and accelerate divides by grad_accum, hence the factor.
    scale = acc.num_processes * config.grad_accum / step_tokens
    sums = {"loss": 0.0, "ce": 0.0, "kl": 0.0}
    grad_norm = None
    for batch in micro:
        with acc.accumulate(run.model):
            parts = _token_loss_sums(run, _on(batch, acc.device), distill=True)
            acc.backward(parts["loss"] * scale)
            for k, v in parts.items():
                sums[k] = sums[k] + v.detach().double()
            if acc.sync_gradients:
                max_norm = config.max_grad_norm if config.max_grad_norm is not None else math.inf
                grad_norm = acc.clip_grad_norm_(run.model.parameters(), max_norm)
                totals = acc.reduce(
                    torch.stack(
                        [torch.as_tensor(sums[k], device=acc.device, dtype=torch.float64) for k in ("loss", "ce", "kl")]
                    ),
                    reduction="sum",
                )
                totals = (totals / step_tokens).tolist()
                # fp16's loss scaler makes overflowing gradients routine (it skips those steps
                # itself); DeepSpeed reports its norm only after its step (None before).
                reported = grad_norm is not None
                norm_is_judged = reported and acc.mixed_precision != "fp16"
                grad_norm = float(grad_norm) if reported else math.nan
                if not math.isfinite(totals[0]) or (norm_is_judged and not math.isfinite(grad_norm)):
                    run.optimizer.zero_grad()
                    return {
                        "train/loss": totals[0],
                        "train/grad_norm": grad_norm,
                        "train/lr": lr,
                        "finite": False,
                        "tokens": int(step_tokens),
                    }
                run.optimizer.step()
                if not reported:  # DeepSpeed: its own clipping ran in the step; ask for the norm it saw
                    after = acc.clip_grad_norm_(run.model.parameters(), math.inf)
                    grad_norm = float(after) if after is not None else math.nan
                run.optimizer.zero_grad()
    record = {"train/loss": totals[0], "train/lr": lr, "train/grad_norm": grad_norm, "finite": True}
    record["tokens"] = int(step_tokens)  # the targets the loss read on every process, padding not counted
    if run.teacher is not None:
        record.update({"train/ce_loss": totals[1], "train/distill_kl": totals[2]})
    return record
