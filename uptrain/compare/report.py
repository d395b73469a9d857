"""The comparison's table (CSV and Markdown) and its plots, in the shapes of the GQA paper's
Fig. 4 (strategies), Fig. 5 (quality vs uptraining), Fig. 6 (quality and cost vs KV heads, and
time per sample vs KV heads) and Fig. 3 (quality vs time per sample). Each file is written whole
or not at all (`checkpoint.atomic.atomic_file`): a kill leaves the previous report or the new one."""

from __future__ import annotations

import csv
import hashlib
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from uptrain.checkpoint.atomic import atomic_file, write_file
from uptrain.compare.study import MHA, RunResult, recorded_group
from uptrain.compare.task_report import prediction_tables, write_task_plots
from uptrain.compare.task_rows import task_column
from uptrain.convert.kv_heads import cross_weight
from uptrain.convert.spec import distinct_heads

# Measured at each row's G (`uptrain.compare.speed_rows`); empty where speed was not measured.
SPEED_COLUMNS = ["time_per_sample_s", "decode_tokens_per_s", "kv_cache_bytes"]
SPEED_PLOTS = ("quality_vs_time_per_sample.png", "time_per_sample_vs_kv_heads.png")
COLUMNS = [
    "num_kv_heads",
    "pooling",
    "eval_loss_before",
    "perplexity_before",
    "eval_loss_after",
    "perplexity_after",
    "gap_to_mha_before",
    "gap_to_mha_after",
    "kv_cache_bytes_per_token",
    "uptrain_tokens",
    *SPEED_COLUMNS,
]


# A --kv-budget compare's own columns, after `pooling` (absent from a compare of -g runs alone).
BUDGET_COLUMNS = ["kv_budget", "allocation", "kv_heads_per_layer", "same_heads_as"]
BUDGET_PLOT = "quality_vs_kv_bytes.png"
# A compare with MLA runs (--target mla): their latent, after the budget columns (a GQA row's empty, its
# target gqa); an MLA row's `pooling` is its --mla-init, its `num_kv_heads` empty (a latent has none).
MLA_COLUMNS = ["target", "kv_rank", "rope_dims", "rotary_key", "rope_stride", "rope_residual"]
# An encoder–decoder's cross-attention cache, after `kv_cache_bytes_per_token` (then its decoder
# self-attention's per target token): per source position, a length of its own.
CROSS_COLUMN = "cross_kv_cache_bytes_per_source_token"


def budget_runs(results: list[RunResult]) -> list[RunResult]:
    """The --kv-budget runs of a compare."""
    return [r for r in results if r.kv_budget is not None]


def latent_runs(results: list[RunResult]) -> list[RunResult]:
    """The MLA runs of a compare (--target mla)."""
    return [r for r in results if r.target == "mla"]


def encoder_decoder(results: list[RunResult]) -> bool:
    """Whether the compare's model caches a cross-attention (its rows' KV bytes come in two lengths)."""
    return any(r.cross_kv_cache_bytes_per_source_token is not None for r in results)


def budget_bytes(r: RunResult, cross_kv_weight: float | None = None) -> float:
    """A run's KV bytes as `--kv-budget` counts them (`kv_heads.head_weights`): per generated token,
    an encoder–decoder's cross-attention's per source position weighing `cross_kv_weight` R (the
    source positions cached per generated token; without R, 1: every head alike). A budget run's is
    its budget × MHA's (at most, for a calibrated allocation)."""
    cross = r.cross_kv_cache_bytes_per_source_token or 0
    return r.kv_cache_bytes_per_token + float(cross_weight(cross_kv_weight) * cross)


def budget_bytes_text(results: list[RunResult], cross_kv_weight: float | None = None, short: bool = False) -> str:
    """What `budget_bytes` counts, in KiB, for a plot's axis (`short`: a narrow one's)."""
    if not encoder_decoder(results):
        return "KV cache KiB / token" if short else "KV cache KiB per token"
    weight = f"{float(cross_weight(cross_kv_weight)):g} × " if cross_kv_weight is not None else ""
    if short:
        return f"KV KiB: self + {weight}cross"
    return f"KV cache KiB per target token: self + {weight}cross per source position"


def _heads(r: RunResult) -> str | tuple:
    """What identifies a run's conversion shape, for `same_heads_as`: one G in every converted layer
    (a -g run or a budget run that resolved to one G), else its heads layer by layer; an MLA run's latent."""
    if r.target == "mla":
        return ("MLA", r.kv_rank, r.rope_dims, r.rotary_key, r.rope_stride, r.rope_residual)
    if r.kv_heads_per_layer is None:
        return ("G", r.num_kv_heads)
    heads = distinct_heads(r.kv_heads_per_layer)
    return ("G", int(heads.pop())) if len(heads) == 1 else r.kv_heads_per_layer


def same_heads_as(results: list[RunResult]) -> dict[str, str]:
    """Each budget run whose KV heads (every layer's) and pooling equal an earlier row's → that
    row's name: the same conversion, so the same model to train (a budget that leaves no choice, a
    calibrated allocation that chose uniform). Such rows are still trained and shown, marked."""
    same = {}
    for i, r in enumerate(results):
        if r.kv_budget is None:
            continue
        earlier = next((e for e in results[:i] if e.pooling == r.pooling and _heads(e) == _heads(r)), None)
        if earlier is not None:
            same[r.name] = earlier.name
    return same


def task_columns(results: list[RunResult]) -> dict[str, str]:
    """Each --task scored in the comparison → its column (`qa:f1`), in the order the tasks were given."""
    columns: dict[str, str] = {}
    for r in results:
        for task, summary in (r.tasks or {}).items():
            columns.setdefault(task, task_column(task, summary))
    return columns


def columns_of(results: list[RunResult]) -> list[str]:
    """The results table's columns: COLUMNS (with BUDGET_COLUMNS after `pooling` where there are
    budget runs, CROSS_COLUMN after the KV bytes per token for an encoder–decoder), then one per task."""
    columns = list(COLUMNS)
    if encoder_decoder(results):
        columns.insert(columns.index("kv_cache_bytes_per_token") + 1, CROSS_COLUMN)
    if budget_runs(results):
        at = columns.index("pooling") + 1
        columns[at:at] = BUDGET_COLUMNS + (MLA_COLUMNS if latent_runs(results) else [])
    return columns + list(task_columns(results).values())


def table_rows(results: list[RunResult]) -> list[dict]:
    """One row per run. Gaps are eval-loss differences to the MHA row at the same point: before
    uptraining (the original model) and after (MHA trained with the same budget). Each task's
    column holds the uptrained checkpoint's score (empty where it was not scored)."""
    mha = next(r for r in results if r.pooling == MHA)
    tasks = task_columns(results)
    same = same_heads_as(results)
    budget = bool(budget_runs(results))
    latent = bool(latent_runs(results))
    cross = encoder_decoder(results)
    return [
        {
            "num_kv_heads": r.num_kv_heads,
            "pooling": r.pooling,
            **(
                {
                    "kv_budget": r.kv_budget,
                    "allocation": r.allocation,
                    "kv_heads_per_layer": r.kv_heads_per_layer,
                    "same_heads_as": same.get(r.name),
                }
                if budget
                else {}
            ),
            **(
                {
                    "target": r.target or (None if r.pooling == MHA else "gqa"),
                    "kv_rank": r.kv_rank,
                    "rope_dims": r.rope_dims,
                    "rotary_key": r.rotary_key,
                    "rope_stride": r.rope_stride,
                    "rope_residual": r.rope_residual,
                }
                if latent
                else {}
            ),
            "eval_loss_before": r.eval_loss_before,
            "perplexity_before": r.perplexity_before,
            "eval_loss_after": r.eval_loss_after,
            "perplexity_after": r.perplexity_after,
            "gap_to_mha_before": r.eval_loss_before - mha.eval_loss_before,
            "gap_to_mha_after": r.eval_loss_after - mha.eval_loss_after,
            "kv_cache_bytes_per_token": r.kv_cache_bytes_per_token,
            **({CROSS_COLUMN: r.cross_kv_cache_bytes_per_source_token} if cross else {}),
            "uptrain_tokens": r.uptrain_tokens,
            **{k: r.speed[k] if r.speed else None for k in SPEED_COLUMNS},
            **{column: _task_score(r, task) for task, column in tasks.items()},
        }
        for r in results
    ]


def _task_score(r: RunResult, task: str) -> float | None:
    summary = (r.tasks or {}).get(task)
    return None if summary is None else summary["primary"]["value"]


def write_csv(rows: list[dict], path: Path, columns: list[str] = COLUMNS) -> None:
    with atomic_file(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def markdown(rows: list[dict], speeds: list[dict] = ()) -> str:
    """The table for people; with the rows' speed measurements, a line saying how and where the
    speed columns were measured. With budget runs, their budget, allocation and heads per layer; for
    an encoder–decoder, its two caches' bytes apart (per target token, per source position)."""
    budget, cross = "kv_budget" in rows[0], CROSS_COLUMN in rows[0]
    head = (
        "| G | pooling | loss α=0 | ppl α=0 | Δ MHA α=0 | loss after | ppl after | Δ MHA after "
        "| KV bytes/token | uptrain tokens | time/sample s | decode tokens/s | KV cache MiB |"
    )
    if budget:
        head = head.replace("| G | pooling |", "| G | budget | allocation | KV heads per layer | pooling |")
    if "target" in rows[0]:
        head = head.replace(
            "KV heads per layer | pooling |", "KV heads per layer (MLA: latent) | pooling (MLA: init) |"
        )
    if cross:
        head = head.replace("| KV bytes/token |", "| KV self bytes/target token | KV cross bytes/source position |")
    lines = [head, "|" + "---:|" * 2 + "---|" * (3 * budget) + "---:|" * (11 + cross)]
    for r in rows:
        measured = (
            "— | — | —"
            if r["time_per_sample_s"] is None
            else f"{r['time_per_sample_s']:.3f} | {r['decode_tokens_per_s']:.1f} | {r['kv_cache_bytes'] / 2**20:.2f}"
        )
        first = f"| {r['num_kv_heads']} | {r['pooling']} |"
        if budget:
            first = f"| {_budget_cells(r)} | {r['pooling']} |"
        lines.append(
            f"{first} {r['eval_loss_before']:.4f} | "
            f"{r['perplexity_before']:.1f} | {r['gap_to_mha_before']:+.4f} | {r['eval_loss_after']:.4f} | "
            f"{r['perplexity_after']:.1f} | {r['gap_to_mha_after']:+.4f} | "
            f"{r['kv_cache_bytes_per_token']:,} | "
            + (f"{r[CROSS_COLUMN]:,} | " if cross else "")
            + f"{r['uptrain_tokens']:,} | {measured} |"
        )
    if cross:
        lines += [
            "",
            "KV bytes of the two caches, apart: the decoder self-attention's per target token, the cross-attention's "
            "per source position (encoded once). A --kv-budget counts self + R × cross (R: --cross-kv-weight, the "
            "source positions per generated token; default 1).",
        ]
    if budget and any(r["same_heads_as"] for r in rows):
        lines += [
            "",
            "= ROW: the same KV heads in every layer and the same pooling as ROW, so the same conversion (a "
            "budget that leaves no other allocation, or a calibrated one that chose uniform); trained again all "
            "the same.",
        ]
    if speeds:  # a resumed compare may have measured some G elsewhere: name every machine
        machines = " and ".join(sorted({s["machine"] for s in speeds}))
        lines += [
            "",
            f"Speed: {speed_setting_text(speeds[0])}, measured on {machines}; one measurement per G "
            + ("or allocation of KV heads " if budget else "")
            + "(speed does not depend on the weights' values).",
        ]
    return "\n".join(lines) + "\n"


def _budget_cells(r: dict) -> str:
    """A row's G, budget, allocation and heads cells: a -g row's budget is its G's fraction, shown
    as —; a mixed allocation's G is the largest layer's (the config's scalar), shown as its heads."""
    if r["kv_budget"] is None:
        return f"{r['num_kv_heads']} | — | — | {r['num_kv_heads']} in every layer"
    if r.get("target") == "mla":  # a latent of rank R and a rotary key of D columns in every layer
        return f"MLA | {r['kv_budget']:g} | — | {latent_text(r, r['rotary_key'] + ' key')}"
    mixed = len(distinct_heads(r["kv_heads_per_layer"])) > 1
    allocation = r["allocation"] + (f" (= {r['same_heads_as']})" if r["same_heads_as"] else "")
    return f"{'mixed' if mixed else r['num_kv_heads']} | {r['kv_budget']:g} | {allocation} | {r['kv_heads_per_layer']}"


def latent_text(r: dict, *notes: str) -> str:
    """An MLA row's latent as the tables show it, "R = 28 + D = 4", with `notes` and its --rope-stride
    and --rope-residual where they are not the defaults (1, 0) in brackets after it:
    "R = 28 + D = 4 (calibrated key, rope stride 2, rope residual 1)"."""
    notes += (f"rope stride {r['rope_stride']}",) if r.get("rope_stride") not in (None, 1) else ()
    notes += (f"rope residual {r['rope_residual']}",) if r.get("rope_residual") else ()
    return f"R = {r['kv_rank']} + D = {r['rope_dims']}" + (f" ({', '.join(notes)})" if notes else "")


def table1_markdown(results: list[RunResult]) -> str:
    """The paper's Table 1 view: each task's score after uptraining and the time per sample, per
    G and pooling (the time where speed was measured: one measurement per G)."""
    tasks = task_columns(results)
    lines = [
        "| G | pooling | " + " | ".join(tasks.values()) + " | time/sample s |",
        "|---:|---|" + "---:|" * (len(tasks) + 1),
    ]
    for r in results:
        scores = [_task_score(r, task) for task in tasks]
        shown = ["—" if v is None else f"{v:.4g}" for v in scores]
        time = "—" if not r.speed else f"{r.speed['time_per_sample_s']:.3f}"
        lines.append(f"| {r.num_kv_heads} | {r.pooling} | " + " | ".join(shown) + f" | {time} |")
    better = "; ".join(
        f"{column}: {'higher' if _primary(results, task)['higher_is_better'] else 'lower'} is better"
        for task, column in tasks.items()
    )
    return "\n".join(lines) + f"\n\n{better}.\n"


def _primary(results: list[RunResult], task: str) -> dict:
    return next(r.tasks[task]["primary"] for r in results if r.tasks and task in r.tasks)


def source_text(speed: dict) -> str:
    """What was fed before decoding: a prompt, or an encoder–decoder's source (encoded once)."""
    if speed.get("cross_attention_cache_bytes") is not None:
        return f"{speed['context']}-token source encoded once"
    return f"{speed['context']}-token prompt"


def speed_setting_text(speed: dict) -> str:
    caches = "both KV caches" if speed.get("cross_attention_cache_bytes") is not None else "the KV cache"
    return (
        f"greedy decoding of batch {speed['batch']}, {source_text(speed)} + {speed['new_tokens']} new "
        f"tokens with {caches}, {speed['device']} {speed['dtype']}, median of {speed['repeats']}"
    )


def tokens_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """Uptraining tokens at which an eval-loss curve first reaches `target` (linear between
    evaluations); None if it never does."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if l0 <= target:
            return float(t0)
        if l1 <= target:
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return float(curve[0][0]) if len(curve) == 1 and curve[0][1] <= target else None


def against_mean(results: list[RunResult]) -> list[dict]:
    """For each strategy other than mean, per G: the share of mean pooling's loss gap to MHA it
    closes (before and after uptraining), and the tokens it needs to reach mean's final loss.
    The -g runs only (a budget run's G is not one G: `against_uniform` compares those)."""
    mha = next(r for r in results if r.pooling == MHA)
    results = [r for r in results if r.kv_budget is None]
    rows = []
    for mean in (r for r in results if r.pooling == "mean"):
        for other in (r for r in results if r.num_kv_heads == mean.num_kv_heads and r.pooling not in (MHA, "mean")):
            rows.append(
                {
                    "num_kv_heads": mean.num_kv_heads,
                    "pooling": other.pooling,
                    "gap_closed_before": closed(other.eval_loss_before, mean.eval_loss_before, mha.eval_loss_before),
                    "gap_closed_after": closed(other.eval_loss_after, mean.eval_loss_after, mha.eval_loss_after),
                    "tokens_to_mean_final": tokens_to_reach(other.curve, mean.eval_loss_after),
                    "mean_tokens": mean.uptrain_tokens,
                }
            )
    return rows


def closed(loss_other: float, loss_base: float, loss_mha: float) -> float:
    """The share of the baseline's eval-loss (log-perplexity) gap to MHA that `loss_other` closes."""
    return (loss_base - loss_other) / (loss_base - loss_mha) if loss_base != loss_mha else math.nan


def against_uniform(results: list[RunResult]) -> list[dict]:
    """For each budget and pooling run with both allocations: the share of the uniform allocation's
    eval-loss (log-perplexity) gap to MHA that the calibrated allocation closes, before and after
    uptraining (the issue's measure: at equal KV bytes, what spending them per layer buys)."""
    mha = next(r for r in results if r.pooling == MHA)
    runs = budget_runs(results)
    rows = []
    for uniform in (r for r in runs if r.allocation == "uniform"):
        for other in runs:
            if (other.kv_budget, other.pooling, other.allocation) != (uniform.kv_budget, uniform.pooling, "calibrated"):
                continue
            rows.append(
                {
                    "kv_budget": uniform.kv_budget,
                    "pooling": uniform.pooling,
                    "uniform_heads": uniform.kv_heads_per_layer,
                    "calibrated_heads": other.kv_heads_per_layer,
                    "gap_closed_before": closed(other.eval_loss_before, uniform.eval_loss_before, mha.eval_loss_before),
                    "gap_closed_after": closed(other.eval_loss_after, uniform.eval_loss_after, mha.eval_loss_after),
                }
            )
    return rows


def against_gqa(results: list[RunResult]) -> list[dict]:
    """For each MLA run: the share of the GQA run's eval-loss (log-perplexity) gap to MHA that it
    closes at the same budget (so the same KV bytes), before and after uptraining, against the GQA
    run of uniform allocation and calibrated pooling (the calibrated GQA merge; negative: MLA is
    worse). MLA runs without that GQA run in the compare are not compared."""
    mha = next(r for r in results if r.pooling == MHA)
    gqa = {
        r.kv_budget: r
        for r in budget_runs(results)
        if (r.target, r.allocation, r.pooling) == (None, "uniform", "calibrated")
    }
    rows = []
    for latent in latent_runs(results):
        if (base := gqa.get(latent.kv_budget)) is None:
            continue
        rows.append(
            {
                "kv_budget": latent.kv_budget,
                "mla_init": latent.pooling,
                "kv_rank": latent.kv_rank,
                "rope_dims": latent.rope_dims,
                "rope_stride": latent.rope_stride,
                "rope_residual": latent.rope_residual,
                "gqa_heads": base.kv_heads_per_layer,
                "gap_closed_before": closed(latent.eval_loss_before, base.eval_loss_before, mha.eval_loss_before),
                "gap_closed_after": closed(latent.eval_loss_after, base.eval_loss_after, mha.eval_loss_after),
            }
        )
    return rows


def _gap_closed_markdown(rows: list[dict], baseline: str, before: list[tuple[str, str]], cells, after=()) -> str:
    """A table of the share of `baseline`'s eval-loss gap to MHA each row closes, at α = 0 and after
    uptraining: `before` and `after` the (header, alignment) of the columns either side of the two
    shares, `cells(row)` a row's cells in that order (`_shares(row)` where the shares go)."""
    closed = [(f"share of {baseline}'s gap to MHA closed, α = 0", "---:"), ("same, after uptraining", "---:")]
    columns = [*before, *closed, *after]
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "".join(f"{a}|" for _, a in columns)]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _shares(r: dict) -> list[str]:
    """A comparison row's two shares of the gap closed, as the tables show them."""
    return [f"{r['gap_closed_before']:.1%}", f"{r['gap_closed_after']:.1%}"]


def against_gqa_markdown(rows: list[dict]) -> str:
    def cells(r: dict) -> list[str]:
        return [f"{r['kv_budget']:g}", r["mla_init"], latent_text(r), r["gqa_heads"], *_shares(r)]

    columns = [("budget", "---:"), ("MLA init", "---"), ("MLA latent", "---")]
    return _gap_closed_markdown(rows, "GQA", [*columns, ("GQA heads (uniform, calibrated pooling)", "---")], cells)


def against_uniform_markdown(rows: list[dict]) -> str:
    def cells(r: dict) -> list[str]:
        same = r["uniform_heads"] == r["calibrated_heads"]
        shown = ["— (the same heads)"] * 2 if same else _shares(r)
        return [f"{r['kv_budget']:g}", r["pooling"], r["uniform_heads"], r["calibrated_heads"], *shown]

    columns = [("budget", "---:"), ("pooling", "---"), ("uniform heads", "---"), ("calibrated heads", "---")]
    return _gap_closed_markdown(rows, "uniform", columns, cells)


def against_mean_markdown(rows: list[dict]) -> str:
    def cells(r: dict) -> list[str]:
        reach = (
            "never"
            if r["tokens_to_mean_final"] is None
            else f"{r['tokens_to_mean_final']:,.0f} ({r['tokens_to_mean_final'] / r['mean_tokens']:.0%} of mean's)"
        )
        return [str(r["num_kv_heads"]), r["pooling"], *_shares(r), reach]

    after = [("tokens to reach mean's final loss", "---:")]
    return _gap_closed_markdown(rows, "mean", [("G", "---:"), ("pooling", "---")], cells, after)


@dataclass(frozen=True)
class _Drawn:
    """What the figures of a compare draw: every run, the MHA one apart, the strategies in the
    order they ran, the G values (largest first) and one colour per strategy."""

    results: list[RunResult]
    mha: RunResult
    runs: list[RunResult]
    strategies: list[str]
    groups: list[int]
    colors: dict[str, str]
    cross_kv_weight: float | None  # how the KV bytes are counted (`budget_bytes`)


def write_plots(results: list[RunResult], folder: Path, cross_kv_weight: float | None = None) -> list[Path]:
    """The paper's figures over MHA and the -g runs (where there are any), the quality against KV
    bytes plot where there are budget runs, and each task's plot; KV bytes as the budget counts them
    (`budget_bytes`, an encoder–decoder's cross-attention's weighing the compare's `cross_kv_weight`)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    mha = next(r for r in results if r.pooling == MHA)
    grouped = [r for r in results if r.kv_budget is None]  # MHA and the -g runs: one G each
    runs = [r for r in grouped if r.pooling != MHA]
    paths = []
    if runs:
        strategies = sorted({r.pooling for r in runs}, key=[r.pooling for r in runs].index)
        groups = sorted({r.num_kv_heads for r in runs}, reverse=True)
        colors = {p: f"C{i}" for i, p in enumerate(strategies)}
        drawn = _Drawn(grouped, mha, runs, strategies, groups, colors, cross_kv_weight)
        paths += [draw(plt, drawn, folder) for draw in (_loss_curves, _quality_vs_kv_heads, _strategies)]
    if budget_runs(results):
        paths.append(_quality_vs_kv_bytes(plt, results, folder, cross_kv_weight))
    paths += write_task_plots(results, list(task_columns(results)), folder, _save)
    if runs and all(r.speed for r in grouped):
        paths += _speed_plots(mha, runs, strategies, colors, folder)
    else:  # a rerun without speed: no plot left from an earlier one contradicts the table
        for name in SPEED_PLOTS:
            (folder / name).unlink(missing_ok=True)
    return paths


def _quality_vs_kv_bytes(plt, results: list[RunResult], folder: Path, cross_kv_weight: float | None) -> Path:
    """Quality against the KV cache it costs: each run's perplexity at α = 0 and after uptraining
    against its KV bytes as its budget counts them (`budget_bytes`: measured on its converted
    checkpoint, summed layer by layer, an encoder–decoder's cross-attention's weighed);
    colour = pooling (an MLA run's: its init), marker = how the heads were chosen (one G, or a budget's
    allocation) or an MLA latent."""
    mha = next(r for r in results if r.pooling == MHA)
    runs = [r for r in results if r.pooling != MHA]
    strategies = sorted({r.pooling for r in runs}, key=[r.pooling for r in runs].index)
    colors = {p: f"C{i}" for i, p in enumerate(strategies)}
    markers = {None: "o", "uniform": "s", "calibrated": "^", "mla": "D"}
    kinds = {None: "one G (-g)", "uniform": "budget, uniform", "calibrated": "budget, calibrated", "mla": "MLA latent"}

    def kind(r: RunResult) -> str | None:
        return "mla" if r.target == "mla" else r.allocation

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for ax, when in zip(axes, ("before", "after")):
        for r in runs:
            loss = r.eval_loss_before if when == "before" else r.eval_loss_after
            x = budget_bytes(r, cross_kv_weight) / 1024
            # Runs at one point (equal bytes, close quality) stay apart: uniform left, calibrated right, MLA further.
            x *= {None: 1.0, "uniform": 0.97, "calibrated": 1.03, "mla": 1.1}[kind(r)]
            ax.plot(x, math.exp(loss), marker=markers[kind(r)], color=colors[r.pooling], ms=7, ls="none")
            if kind(r) in ("calibrated", "mla"):
                label = r.kv_heads_per_layer if kind(r) == "calibrated" else latent_text(asdict(r))
                ax.annotate(label, (x, math.exp(loss)), fontsize=7, xytext=(5, 2), textcoords="offset points")
        mha_loss = mha.eval_loss_before if when == "before" else mha.eval_loss_after
        mha_bytes = budget_bytes(mha, cross_kv_weight) / 1024
        ax.plot(mha_bytes, math.exp(mha_loss), marker="*", ms=11, color="black", ls="none")
        ax.axhline(math.exp(mha_loss), color="black", ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(lambda x, _: f"{x:g}")  # 1.5, 3, 12: not 2^1
        small = 8 if encoder_decoder(results) else None  # the longer label
        ax.set_xlabel(f"{budget_bytes_text(results, cross_kv_weight)} (log scale)", fontsize=small)
        ax.set_title(
            "right after conversion (α = 0)"
            if when == "before"
            else f"after uptraining ({mha.uptrain_tokens:,} tokens)"
        )
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("eval perplexity (lower is better)")

    def what(p: str) -> str:
        uses = {"pooling" if r.target != "mla" else "init (MLA)" for r in runs if r.pooling == p}
        return " / ".join(sorted(uses, reverse=True))

    handles = (
        [plt.Line2D([], [], color=colors[p], marker="o", ls="none", label=f"{p} {what(p)}") for p in strategies]
        + [
            plt.Line2D([], [], color="grey", marker=markers[a], ls="none", label=kinds[a])
            for a in kinds
            if any(kind(r) == a for r in runs)
        ]
        + [plt.Line2D([], [], color="black", marker="*", ls="none", label="MHA (dashed)")]
    )
    axes[1].legend(handles=handles, fontsize=8)
    fig.tight_layout()
    return _save(fig, folder / BUDGET_PLOT)


def _loss_curves(plt, drawn: _Drawn, folder: Path) -> Path:
    """Fig. 5 shape: eval loss along uptraining, one panel per G."""
    mha, runs, groups, colors = drawn.mha, drawn.runs, drawn.groups, drawn.colors
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.6), sharey=True, squeeze=False)
    for ax, g in zip(axes[0], groups):
        for r in (r for r in runs if r.num_kv_heads == g):
            tokens, losses = zip(*r.curve)
            ax.plot(tokens, losses, marker="o", ms=3, color=colors[r.pooling], label=r.pooling)
        tokens, losses = zip(*mha.curve)
        ax.plot(tokens, losses, color="black", ls="--", label="MHA")
        ax.set_title(f"G = {g}" + (" (MQA)" if g == 1 else ""))
        ax.set_xlabel("uptraining tokens")
        ax.xaxis.set_major_formatter(lambda x, _: f"{x / 1000:g}k" if x else "0")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("eval loss")
    axes[0][-1].legend()
    fig.tight_layout()
    return _save(fig, folder / "loss_vs_uptraining.png")


def _quality_vs_kv_heads(plt, drawn: _Drawn, folder: Path) -> Path:
    """Fig. 6 shape: final quality and KV-cache size against the number of KV heads."""
    results, mha, runs, strategies, colors = drawn.results, drawn.mha, drawn.runs, drawn.strategies, drawn.colors
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for p in strategies:
        points = sorted((r.num_kv_heads, r.eval_loss_after) for r in runs if r.pooling == p)
        ax.plot(*zip(*points), marker="o", color=colors[p], label=f"{p} (after uptraining)")
    ax.axhline(mha.eval_loss_after, color="black", ls="--", label="MHA (same uptraining)")
    ax.plot([mha.num_kv_heads], [mha.eval_loss_after], marker="s", color="black")
    ax.set_xscale("log", base=2)
    ax.set_xticks(
        sorted({r.num_kv_heads for r in results}), [str(g) for g in sorted({r.num_kv_heads for r in results})]
    )
    ax.minorticks_off()
    ax.set_xlabel("KV heads G")
    ax.set_ylabel("eval loss")
    twin = ax.twinx()
    sizes = sorted(
        {(r.num_kv_heads, budget_bytes(r, drawn.cross_kv_weight)) for r in runs}
        | {(mha.num_kv_heads, budget_bytes(mha, drawn.cross_kv_weight))}
    )
    twin.bar(
        [g for g, _ in sizes],
        [b / 1024 for _, b in sizes],
        width=[0.25 * g for g, _ in sizes],
        color="grey",
        alpha=0.25,
    )
    twin.set_ylabel(f"{budget_bytes_text(results, drawn.cross_kv_weight, short=True)} (bars)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, folder / "quality_vs_kv_heads.png")


def _strategies(plt, drawn: _Drawn, folder: Path) -> Path:
    """Fig. 4 shape: strategies side by side, before and after uptraining."""
    results, mha, runs, strategies, groups, colors = (
        drawn.results,
        drawn.mha,
        drawn.runs,
        drawn.strategies,
        drawn.groups,
        drawn.colors,
    )
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    width = 0.8 / max(1, len(strategies))
    for ax, when in zip(axes, ("before", "after")):
        for i, p in enumerate(strategies):
            xs, ys = [], []
            for k, g in enumerate(groups):
                r = next((r for r in runs if r.num_kv_heads == g and r.pooling == p), None)
                if r is not None:
                    xs.append(k + i * width)
                    ys.append(r.eval_loss_before if when == "before" else r.eval_loss_after)
            ax.bar(xs, ys, width=width, color=colors[p], label=p)
        ax.axhline(mha.eval_loss_before if when == "before" else mha.eval_loss_after, color="black", ls="--")
        ax.set_xticks([k + width * (len(strategies) - 1) / 2 for k in range(len(groups))], [f"G={g}" for g in groups])
        ax.set_title(
            "right after conversion (α = 0)"
            if when == "before"
            else f"after uptraining ({runs[0].uptrain_tokens:,} tokens)"
        )
        finite = [r.eval_loss_before for r in results] + [r.eval_loss_after for r in results]
        ax.set_ylim(min(finite) * 0.95, max(v for v in finite if math.isfinite(v)) * 1.02)
    axes[0].set_ylabel("eval loss (dashed: MHA)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, folder / "strategies.png")


def _speed_plots(
    mha: RunResult, runs: list[RunResult], strategies: list[str], colors: dict, folder: Path
) -> list[Path]:
    """Fig. 3 shape (quality after uptraining against time per sample) and Fig. 6's speed half
    (time per sample against G), error bars spanning the repeats' min to max."""
    import matplotlib.pyplot as plt

    def spread(r: RunResult) -> list[list[float]]:
        low, high = r.speed["spread"]["time_per_sample_s"]["min"], r.speed["spread"]["time_per_sample_s"]["max"]
        return [[r.speed["time_per_sample_s"] - low], [high - r.speed["time_per_sample_s"]]]

    m = mha.speed
    setting = (
        f"greedy, batch {m['batch']}, {source_text(m)} + {m['new_tokens']} new tokens, "
        f"{m['device']} {m['dtype']}, median of {m['repeats']}"
    )
    fig, ax = plt.subplots(figsize=(6.4, 4.4))

    def point(r: RunResult, label: str, marker: str, color: str) -> None:
        x, y = r.speed["time_per_sample_s"], r.eval_loss_after
        ax.errorbar(x, y, xerr=spread(r), marker=marker, color=color, ms=7, capsize=3, ls="none")
        ax.annotate(label, (x, y), fontsize=8, xytext=(6, 3), textcoords="offset points")

    markers = dict(zip(sorted({r.num_kv_heads for r in runs}, reverse=True), "o^vDPX*"))
    for p in strategies:
        for r in (r for r in runs if r.pooling == p):
            point(r, f"G={r.num_kv_heads} {p}", markers[r.num_kv_heads], colors[p])
    point(mha, f"MHA (G={mha.num_kv_heads})", "s", "black")
    ax.margins(x=0.25, y=0.1)
    ax.set_xlabel("time per sample, s (bars: min–max of the repeats)")
    ax.set_ylabel("eval loss after uptraining (lower is better)")
    ax.set_title(f"quality vs time per sample\n{setting}", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths = [_save(fig, folder / SPEED_PLOTS[0])]

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    measured = sorted({r.num_kv_heads: r for r in [*runs, mha]}.items())  # one measurement per G
    gs = [g for g, _ in measured]
    ax.errorbar(
        gs,
        [r.speed["time_per_sample_s"] for _, r in measured],
        yerr=[sum((spread(r)[i] for _, r in measured), []) for i in (0, 1)],
        marker="o",
        color="C0",
        capsize=3,
        label="measured (one checkpoint per G)",
    )
    ax.plot(
        [mha.num_kv_heads], [mha.speed["time_per_sample_s"]], marker="s", ms=8, color="black", ls="none", label="MHA"
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks(gs, [str(g) for g in gs])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("KV heads G")
    ax.set_ylabel("time per sample, s")
    ax.set_title(f"time per sample vs KV heads\n{setting}", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(_save(fig, folder / SPEED_PLOTS[1]))
    return paths


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=110, format=path.suffix[1:])  # the temporary's name has no .png
    plt.close(fig)
    return path


def log_to_wandb(results: list[RunResult], files: dict[str, Path], spec) -> Path:
    """Log the comparison to wandb as one more run of the compare's group (the group its
    training runs share): the results table (`wandb.Table`, the rows of results.csv), the
    comparison against mean pooling when there is one, per --task a table of sample predictions
    of every run (`predictions/<task>`), and the plots. Offline without
    credentials, like the training runs. Returns the wandb run's folder."""
    import wandb

    from uptrain.train.tracking import ensure_wandb_never_prompts

    ensure_wandb_never_prompts()
    root = Path(spec.output_dir).absolute()
    # The group compare.json records, unique to this compare (a report of results made otherwise:
    # the folder's name). One id per compare: a rerun (every run reused) updates this run.
    group = recorded_group(root)
    run_id = "compare-" + hashlib.sha1((group or str(root)).encode()).hexdigest()[:12]
    group = group or root.name
    config = spec.to_dict()
    run = wandb.init(
        project="uptrain",
        group=group,
        name=f"{root.name}/results",
        job_type="compare",
        id=run_id,
        resume="allow",
        dir=str(root),
        config=config,
        reinit="create_new",
    )
    try:
        rows, columns = table_rows(results), columns_of(results)
        logged = {"results": wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])}
        logged.update(prediction_tables(results, list(task_columns(results)), wandb))
        for key, comparisons in (
            ("against_mean", against_mean(results)),
            ("against_uniform", against_uniform(results)),
            ("against_gqa", against_gqa(results)),
        ):
            if comparisons:
                columns = list(comparisons[0])
                logged[key] = wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in comparisons])
        for name, path in files.items():
            if path.suffix == ".png":
                logged[name] = wandb.Image(str(path))
        run.log(logged)
    finally:
        run.finish()
    return Path(run.dir).parent


def write_report(results: list[RunResult], folder: str | Path, spec=None) -> dict[str, Path]:
    """results.csv, results.md and the plots in `folder` (the two speed plots where every row
    has its speed measured); with a CompareSpec whose
    `report_to` includes wandb, also logged to wandb (`log_to_wandb`)."""
    folder = Path(folder)
    rows = table_rows(results)
    write_csv(rows, folder / "results.csv", columns_of(results))
    text = markdown(rows, [r.speed for r in results if r.speed])
    if task_columns(results):
        text += "\nTask scores after uptraining and time per sample (the paper's Table 1):\n\n"
        text += table1_markdown(results)
    comparisons = against_mean(results)
    if comparisons:
        text += "\nAgainst mean pooling (gap = eval loss − MHA eval loss at the same point):\n\n"
        text += against_mean_markdown(comparisons)
    allocations = against_uniform(results)
    if allocations:
        text += "\nCalibrated against uniform allocation at each budget (gap = eval loss − MHA eval loss):\n\n"
        text += against_uniform_markdown(allocations)
    latents = against_gqa(results)
    if latents:
        text += (
            "\nMLA against GQA (uniform allocation, calibrated pooling) at each budget, the same KV bytes "
            "(gap = eval loss − MHA eval loss):\n\n"
        )
        text += against_gqa_markdown(latents)
    write_file(folder / "results.md", text)
    plots = write_plots(results, folder, spec.cross_kv_weight if spec is not None else None)
    files = {"csv": folder / "results.csv", "markdown": folder / "results.md", **{p.stem: p for p in plots}}
    if spec is not None and "wandb" in spec.report_to:
        files["wandb"] = log_to_wandb(results, files, spec)
    return files
