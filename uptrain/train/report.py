"""What a run says and leaves: the plan printed before the first step, each step's performance
metrics, the estimate of the time left, the metrics log, the refusal of a non-finite step, and
final/ with its record of the run (the evaluation before and after)."""

from __future__ import annotations

from pathlib import Path

import torch

from uptrain import UptrainError
from uptrain.train import metrics as M
from uptrain.train.checkpoint import CHECKPOINTS, checkpoint_name
from uptrain.train.setup import Plan, Run

ETA_AFTER_STEPS = 3  # the first steps include warm-up costs; estimate from a few more


def _human(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.4g}"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}"


def log_record(run: Run, step: int, record: dict) -> None:
    """`record` of `step` into metrics.jsonl (main process) and the trackers."""
    record = {"step": step, **record}
    if run.log is not None:
        run.log.append(record)
    run.accelerator.log({k: v for k, v in record.items() if k != "step"}, step=step)


def print_plan(run: Run) -> None:
    """The plan, before the first step of this attempt (with the notes of `setup` above it)."""
    plan, acc = run.plan, run.accelerator
    c, start_step = plan.config, run.progress.start_step
    steps_left = plan.total_steps - start_step
    if c.max_steps is not None:
        budget = f"max_steps {c.max_steps}"
    elif c.max_tokens is not None:
        budget = f"max_tokens {_human(c.max_tokens)}"
    else:
        budget = (
            f"uptrain_fraction {c.uptrain_fraction} × pretrain_tokens {_human(c.pretrain_tokens)} = "
            f"{_human(c.uptrain_fraction * c.pretrain_tokens)} tokens"
        )
    data = run.train_blocks.describe(plan.total_steps)
    distill = "no"
    if c.teacher:
        distill = f"from {c.teacher} (weight {c.distill_weight}, temperature {c.distill_temperature})"
    total_tokens, left_tokens = plan.total_steps * plan.tokens_per_step, steps_left * plan.tokens_per_step
    framing = run.objective.framing
    prompt = f"; prompt {framing.shown}" if framing is not None else ""
    resuming = f" (resuming after step {start_step}, {steps_left} left)" if start_step else ""
    speech = plan.speech
    if speech is not None:  # clips, audio seconds and decoder tokens: seq_len is no length of audio
        size = speech.plan_lines(plan.total_steps, steps_left, c, acc.num_processes)
        data = speech.train_data(plan.total_steps / run.train_blocks.steps_per_epoch)
    else:
        size = [
            f"  tokens           {_human(total_tokens)} ({_human(left_tokens)} to go)",
            f"  tokens per step  {plan.tokens_per_step} = seq_len {c.seq_len} × batch_size {c.batch_size} × "
            f"grad_accum {c.grad_accum} × processes {acc.num_processes}",
        ]
    unit = "blocks" if speech is None else "clips"
    lines = [
        "plan:",
        f"  model            {plan.model_path} ({_cached(plan.static_metrics)}, "
        f"{plan.static_metrics['model/kv_cache_bytes_per_token']} KV-cache bytes/token)",
        f"  budget           {budget}",
        f"  steps            {plan.total_steps}{resuming}",
        *size,
        f"  processes        {acc.num_processes} ({acc.device.type}, mixed precision {acc.mixed_precision})",
        f"  train data       {data}; eval: the same {plan.eval_block_count} {unit} each time",
        f"  objective        {plan.objective}{prompt}",
        f"  distillation     {distill}",
        f"  output           {plan.out}",
    ]
    acc.print("\n".join([*plan.notes, *lines]))


def _cached(metrics: dict) -> str:
    """What each layer caches per token: its KV heads, or a latent and a shared rotary key."""
    if "model/kv_lora_rank" in metrics:
        return f"latent {metrics['model/kv_lora_rank']} + rotary key {metrics['model/qk_rope_head_dim']} per layer"
    return f"{metrics['model/num_kv_heads']} KV heads"


def perf_metrics(run: Run, step_time: float) -> dict:
    """The perf/… metrics of a step that took `step_time` seconds."""
    plan, device = run.plan, run.accelerator.device
    tokens_per_second = plan.tokens_per_step / step_time
    record = {
        "perf/tokens_per_second": tokens_per_second,
        "perf/step_time_s": step_time,
        "perf/data_wait_s": run.train_blocks.last_wait_s,
        "perf/peak_memory_bytes": M.peak_memory_bytes(device),
    }
    if plan.speech is not None:  # tokens/s counts seq_len per clip; clips/s is the speed of a speech run
        record["perf/clips_per_second"] = plan.speech.clips_per_step / step_time
    if plan.peak_flops:
        record["perf/mfu"] = M.mfu(
            tokens_per_second, plan.flops_per_token, plan.peak_flops, run.accelerator.num_processes
        )
    return record


def non_finite(run: Run, step: int, record: dict) -> UptrainError:
    """The refusal of step `step`, whose loss or gradient norm was not finite (it was not applied)."""
    plan, progress = run.plan, run.progress
    where = (
        f"last good checkpoint: {plan.out / CHECKPOINTS / checkpoint_name(progress.checkpoint_step)} "
        f"(step {progress.checkpoint_step})"
        if progress.checkpoint_step
        else "no checkpoint was written before it"
    )
    return UptrainError(
        f"non-finite loss at step {step} (loss {record['train/loss']}, grad norm "
        f"{record['train/grad_norm']}); stopped without applying it; {where}; "
        "a lower lr or more warmup_steps may help"
    )


class RemainingTime:
    """The estimate of the time a run has left, written once, after the first `ETA_AFTER_STEPS`
    steps of an attempt that follow its first (which pays for warm-up and is not counted)."""

    def __init__(self, plan: Plan, start_step: int):
        self.plan, self.start_step = plan, start_step
        self.timed_steps, self.timed_seconds = 0, 0.0

    def after(self, step: int, step_time: float) -> str | None:
        """Count step `step` (done in `step_time` seconds); the line to write, when it is time."""
        done_here = step - self.start_step
        if done_here > 1:  # the first step pays for warm-up; leave it out of the estimate
            self.timed_steps, self.timed_seconds = self.timed_steps + 1, self.timed_seconds + step_time
        if done_here != ETA_AFTER_STEPS + 1 or step >= self.plan.total_steps:
            return None
        per_step = self.timed_seconds / self.timed_steps
        speech = self.plan.speech
        speed = (
            f"{self.plan.tokens_per_step / per_step:,.0f} tokens/s"
            if speech is None
            else f"{speech.clips_per_step / per_step:,.3g} clips/s"
        )
        left = _duration(per_step * (self.plan.total_steps - step))
        return f"estimated remaining: {left} ({per_step:.3g} s/step, {speed})"


def save_final(run: Run, final_metrics: dict) -> Path:
    """Write `final/` as `uptrain convert` writes its output (see `uptrain.train.final`)."""
    from uptrain.train.final import uptrained_card, uptraining_record, write_final

    acc, plan = run.accelerator, run.plan
    state = acc.get_state_dict(run.model)  # gathers sharded (FSDP, ZeRO-3) weights; every process calls it
    final = plan.out / "final"
    if acc.is_main_process:
        step0 = next((r for r in M.read_metrics(plan.out / "metrics.jsonl") if r["step"] == 0 and "eval/loss" in r), {})
        record = uptraining_record(
            Path(plan.model_path),
            # The objective actually trained, where the config left it to the model's family.
            {**plan.config.to_dict(), "objective": plan.objective},
            steps=plan.total_steps,
            tokens=plan.total_steps * plan.tokens_per_step,
            num_processes=acc.num_processes,
            global_batch=plan.tokens_per_step // plan.config.seq_len,
            eval_before={k: v for k, v in step0.items() if k.startswith("eval/")} or None,
            eval_after={k: v for k, v in final_metrics.items() if k.startswith("eval/")},
            start_label=plan.config.model,
            speech=plan.speech.record(plan.total_steps) if plan.speech is not None else None,
        )
        # Tensors the starting checkpoint lacked are written in its declared dtype.
        write_final(
            final,
            Path(plan.model_path),
            acc.unwrap_model(run.model),
            state,
            record,
            uptrained_card(record, Path(plan.model_path)),
            default_dtype=getattr(torch, plan.source_dtype, torch.float32),
        )
    acc.wait_for_everyone()
    return final
