"""The uptraining recipe on Accelerate: one CPU, one GPU, or many processes under `accelerate launch`.

setup (`train/setup.py`: check the models and data, start the run folder, load and prepare the
models, fix the `Plan`) → resume the `Progress` of a checkpoint → evaluate at step 0 → train
(`train/step.py`, with `train/optimizer.py`'s schedule) with evaluation and checkpoints →
evaluate → save `final/` (`train/report.py`, which also prints the plan and the progress).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from tqdm.auto import tqdm

from uptrain.checkpoint.atomic import check_apart
from uptrain.train.checkpoint import load_checkpoint, load_data_state, save_checkpoint
from uptrain.train.config import TrainConfig
from uptrain.train.distributed import leave_together
from uptrain.train.report import RemainingTime, log_record, non_finite, perf_metrics, print_plan, save_final
from uptrain.train.rundir import hold_run_dir
from uptrain.train.setup import Progress, Run, setup
from uptrain.train.step import evaluate, train_step
from uptrain.train.tracking import run_config, start_trackers

StepCallback = Callable[[int, dict], None]


def run_training(config: TrainConfig, on_step: StepCallback | None = None) -> Path:
    """Uptrain as `config` says; returns the folder of the final model. `on_step(step, record)` is
    called on every process after each optimizer step (recipes use it for their own logging)."""
    # Before the lock folder is made: an output_dir inside the model would already pollute it.
    check_apart(Path(config.output_dir), run_inputs(config), "output_dir")
    with hold_run_dir(config.output_dir):  # one run at a time per output_dir; a second is refused at once
        return _run_training(config, on_step)


def run_inputs(config: TrainConfig) -> list[tuple[str, Path]]:
    """Every local path the run reads: output_dir may be none of them, nor inside or around one."""
    named = [("model", config.model), ("source checkpoint", config.source), ("teacher", config.teacher)]
    for key in ("train_data", "eval_data"):
        value = getattr(config, key)
        named += [(f"`{key}`", v) for v in ([value] if isinstance(value, str) else value)]
    return [(what, Path(value)) for what, value in named if value]


def _run_training(config: TrainConfig, on_step: StepCallback | None) -> Path:
    run = setup(config)
    acc, plan = run.accelerator, run.plan
    if run.start.complete:
        acc.print(f"{plan.out} already holds a finished run (final/); nothing to do")
        return plan.out / "final"
    if run.start.checkpoint is not None:
        _resume(run)
    if run.log is not None:
        run.log.truncate_after(run.progress.start_step if run.progress.start_step else -1)
    print_plan(run)
    _start_trackers(run)
    try:
        final = _train(run, on_step)
    except BaseException:
        acc.end_training()  # no barrier: the other processes may have failed too, or be gone
        raise
    leave_together(acc)  # every process finished: leave at a last barrier (see its docstring)
    return final


def _resume(run: Run) -> None:
    """Model, optimizer, RNG and data states from the checkpoint `setup` found; the progress at it."""
    acc, checkpoint = run.accelerator, run.start.checkpoint
    state = load_checkpoint(acc, checkpoint)
    step = state["step"]
    run.train_blocks.load_state_dict(load_data_state(checkpoint, acc.process_index))
    # A speech run's tokens depend on the clips read: the count the checkpoint saved.
    seen = state.get("tokens_seen") if run.plan.speech is not None else None
    seen = seen if isinstance(seen, int) else step * run.plan.tokens_per_step
    run.progress = Progress(start_step=step, step=step, tokens_seen=seen, checkpoint_step=step)
    acc.print(f"resuming from {checkpoint} (step {step})")


def _tokens_seen(plan, step_tokens: int) -> int:
    """What a step adds to `train/tokens_seen`: a text run's seq_len × rows (its blocks are full,
    the budget `max_tokens` / `uptrain_fraction` is counted so); a speech run's target tokens the
    loss read (its clips' transcripts, padded to the longest of each batch: the padding is not
    seen, and a budget stated in tokens seen counts only real ones)."""
    return step_tokens if plan.speech is not None else plan.tokens_per_step


def _start_trackers(run: Run) -> None:
    acc, plan, config = run.accelerator, run.plan, run.plan.config
    run_id = json.loads((plan.out / "run.json").read_text())["wandb_run_id"]
    # The conversion actually done (from the model's uptrain.json), processes and global batch.
    values = run_config(
        config,
        plan.model_path,
        plan.static_metrics["model/num_kv_heads"],
        acc.num_processes,
        plan.tokens_per_step // config.seq_len,
    )
    start_trackers(acc, config, values, run_id, plan.out)


def _train(run: Run, on_step: StepCallback | None) -> Path:
    acc, plan, progress = run.accelerator, run.plan, run.progress
    config = plan.config
    last_eval = None
    if progress.step == 0:
        last_eval = evaluate(run)
        log_record(run, 0, {**last_eval, "train/tokens_seen": 0, **plan.static_metrics})
    bar = tqdm(
        total=plan.total_steps,
        initial=progress.step,
        desc="uptrain",
        unit="step",
        disable=not acc.is_main_process,
        dynamic_ncols=True,
    )
    remaining = RemainingTime(plan, progress.start_step)
    with bar:
        while progress.step < plan.total_steps:
            t0 = time.perf_counter()
            record = train_step(run, progress.step)
            step_time = time.perf_counter() - t0
            progress.step += 1
            progress.tokens_seen += _tokens_seen(plan, record.pop("tokens"))
            step = progress.step
            record.update({"train/tokens_seen": progress.tokens_seen, **perf_metrics(run, step_time)})
            if not record.pop("finite"):
                log_record(run, step, record)
                raise non_finite(run, step, record)
            evaluate_now = step % config.eval_every == 0 or step == plan.total_steps
            if evaluate_now:
                last_eval = evaluate(run)
                record.update(last_eval)
            if step == plan.total_steps:
                record.update(plan.static_metrics)
            if evaluate_now or step % config.log_every == 0 or step == plan.total_steps:
                log_record(run, step, record)
            if step % config.save_every == 0 and step < plan.total_steps:
                _save_checkpoint(run)
            bar.update(1)
            if "perf/clips_per_second" in record:  # speech: clips, not seq_len tokens
                speed = {"clips_s": f"{record['perf/clips_per_second']:,.3g}"}
            else:
                speed = {"tok_s": f"{record['perf/tokens_per_second']:,.0f}"}
            bar.set_postfix(loss=f"{record['train/loss']:.4f}", **speed, refresh=False)
            if (estimate := remaining.after(step, step_time)) is not None:
                bar.write(estimate)
            if on_step is not None:
                on_step(step, record)
    final = save_final(run, last_eval or {})
    acc.print(f"eval/loss {last_eval['eval/loss']:.4f} after {plan.total_steps} steps; uptrained model: {final}")
    return final


def _save_checkpoint(run: Run) -> None:
    acc, plan, progress = run.accelerator, run.plan, run.progress
    trainer_state = {"step": progress.step, "tokens_seen": progress.tokens_seen, "total_steps": plan.total_steps}
    save_checkpoint(
        acc,
        plan.out,
        progress.step,
        trainer_state,
        plan.config.keep_checkpoints,
        data_state=run.train_blocks.state_dict(),
    )
    progress.checkpoint_step = progress.step
