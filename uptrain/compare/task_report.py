"""The task half of the comparison's report: per --task, the paper's Fig. 3 (the task's score after
uptraining against time per sample, one point per G and pooling) and, for wandb, a table of sample
predictions of every run."""

from __future__ import annotations

import json
from pathlib import Path

from uptrain.compare.study import MHA, RunResult
from uptrain.compare.task_rows import sample_predictions, task_column, task_slug

PLOT_SUFFIX = "_vs_time_per_sample.png"
SAMPLES_PER_RUN = 8  # predictions per run and task in wandb's tables: enough to read, small to sync


def plot_name(task: str) -> str:
    return f"task_{task_slug(task)}{PLOT_SUFFIX}"


def write_task_plots(results: list[RunResult], tasks: list[str], folder: Path, save) -> list[Path]:
    """One Fig. 3 plot per task where every run has its speed and the task's score; removes the
    task plots of an earlier report that this one does not draw (`save(fig, path)` writes one)."""
    import matplotlib.pyplot as plt

    drawn = []
    for task in tasks:
        if not all(r.speed and r.tasks and task in r.tasks for r in results):
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        markers = dict(zip(sorted({r.num_kv_heads for r in results}, reverse=True), "so^vDPX*"))
        strategies = list(dict.fromkeys(r.pooling for r in results if r.pooling != MHA))
        for r in results:
            x, y = r.speed["time_per_sample_s"], r.tasks[task]["primary"]["value"]
            mha = r.pooling == MHA
            color = "black" if mha else f"C{strategies.index(r.pooling)}"
            ax.plot(x, y, marker="s" if mha else markers[r.num_kv_heads], color=color, ms=7, ls="none")
            label = f"MHA (G={r.num_kv_heads})" if mha else f"G={r.num_kv_heads} {r.pooling}"
            ax.annotate(label, (x, y), fontsize=8, xytext=(6, 3), textcoords="offset points")
        primary = results[0].tasks[task]["primary"]
        ax.margins(x=0.25, y=0.15)
        ax.set_xlabel("time per sample, s (speed measurement, one per G)")
        better = "higher" if primary["higher_is_better"] else "lower"
        ax.set_ylabel(f"{primary['metric']} after uptraining ({better} is better)")
        ax.set_title(f"{task}: quality vs time per sample", fontsize=9)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        drawn.append(save(fig, folder / plot_name(task)))
    for stale in folder.glob(f"task_*{PLOT_SUFFIX}"):
        if stale not in drawn:
            stale.unlink()
    return drawn


def prediction_tables(results: list[RunResult], tasks: list[str], wandb) -> dict:
    """Per task, a wandb.Table of the first predictions of every run (G, pooling, the example's
    index, reference and prediction), named `predictions/<task>`."""
    tables = {}
    columns = ["num_kv_heads", "pooling", "index", "reference", "prediction"]
    for task in tasks:
        data = []
        for r in results:
            summary = (r.tasks or {}).get(task)
            if summary is None:
                continue
            for record in sample_predictions(summary, SAMPLES_PER_RUN):
                data.append([r.num_kv_heads, r.pooling, record.get("index"), *map(_text, _pair(record))])
        if data:
            tables[f"predictions/{task_slug(task)}"] = wandb.Table(columns=columns, data=data)
    return tables


def _pair(record: dict) -> tuple:
    return record.get("reference"), record.get("prediction")


def _text(value) -> str:
    """A reference or prediction as a table cell: text as it is, lm-eval's structured ones as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


__all__ = ["plot_name", "prediction_tables", "task_column", "write_task_plots"]
