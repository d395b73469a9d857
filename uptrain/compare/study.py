"""`uptrain compare`: convert one MHA model every way asked, uptrain each run identically, collect.

For every (G, pooling), every (KV budget, allocation, pooling) and every (KV budget, MLA init)
(`--target mla`: a latent at the budget's KV bytes), the model is converted,
evaluated at α = 0 (the training loop's step-0 evaluation) and uptrained with the same data, seed,
schedule and token budget. The MHA model itself is trained with the same budget as the reference
row, so that what uptraining alone buys an undertrained model is not credited to GQA. A budget
run's KV heads per layer and its KV bytes per token are read from its converted checkpoint (a
calibrated allocation is chosen during its conversion). Each finished run leaves `result.json`; a killed
compare picks those up and resumes the unfinished run from its last checkpoint.

    output_dir/
      compare.json              the settings (CompareSpec) and the wandb group; marks the folder as a compare
      calibration.safetensors   attention-input moments, shared by every calibrated conversion
      converted/NAME/           each conversion
      runs/NAME/train/          each training run (`uptrain train`'s run folder)
      runs/NAME/result.json     each finished run's row and curve
      runs/NAME/tasks/SLUG/     each run's score on each --task (scores.json, predictions.jsonl)
      results.csv, results.md, *.png, wandb/
      .uptrain-lock             while a compare (or a `uptrain train`) uses the folder

Every file is written whole or not at all (`checkpoint.atomic.atomic_file`), under the folder's
lock; a rerun refuses an earlier compare made with other settings (like `uptrain train --resume`)
and makes again what it finds damaged.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from uptrain import UptrainError
from uptrain.budgets import pretrain_tokens
from uptrain.checkpoint.atomic import atomic_file, check_apart, remove_stale_locks, remove_temporaries, write_file
from uptrain.checkpoint.resumable import ResumeRule, unreadable_record
from uptrain.compare.spec import SPEED, TASKS, CompareSpec
from uptrain.compare.speed_rows import speed_setting, with_speed
from uptrain.compare.task_rows import check_task_scoring, with_tasks
from uptrain.convert.mla import checked_latent, convert_mla
from uptrain.convert.pipeline import Calibration, calibrate, execute, prepare, settle_allocation
from uptrain.convert.spec import kv_heads_per_layer_text, parse_attention
from uptrain.model_info import DTYPE_BYTES, config_dtype, read_config
from uptrain.options import keys_of, names_of
from uptrain.speed_checks import ModelShape, model_shape
from uptrain.strict_json import parse_json, read_json
from uptrain.train.config import OPERATIONAL_KEYS as TRAIN_OPERATIONAL_KEYS
from uptrain.train.metrics import read_metrics
from uptrain.train.rundir import GLOBAL_BATCH_KEYS, LOCK_FILE, hold_run_dir

RESULT = "result.json"
RECORD = "compare.json"
CALIBRATION = "calibration.safetensors"
MHA = "mha"
# Settings a rerun may change: which runs there are (each run is made alike, whatever the others),
# the speed measurement and the task scoring (a change remeasures speed, `speed_rows`, or scores the
# tasks again, `task_rows`, and retrains nothing), and what
# `uptrain train` lets a resumed run change (how the compare is reported, how often the runs
# evaluate, where calibration runs, how a step is computed), but for the keys of the global batch:
# train allows those only with the batch kept, and a finished run keeps the batch it was made with.
OWN_OPERATIONAL_KEYS = frozenset(
    {"num_kv_heads", "kv_budget", "allocation", "pooling", "target", "mla_init", "overwrite", "output_dir"}
)


def operational_keys(keys) -> frozenset[str]:
    """The operational ones among a compare's `keys`, derived from `uptrain train`'s own rule."""
    train = TRAIN_OPERATIONAL_KEYS - GLOBAL_BATCH_KEYS
    # The speed measurement and the task scoring: a change measures or scores again, and retrains nothing.
    after_runs = {k.name for k in keys_of(CompareSpec) if k.option.group in (SPEED, TASKS)}
    return frozenset(k for k in keys if k in OWN_OPERATIONAL_KEYS | after_runs | train)


def resume_rule() -> ResumeRule:
    """What identifies a compare: every setting but the operational ones. A key the earlier
    compare's uptrain did not have yet held its default there."""
    return ResumeRule.for_schema(CompareSpec, operational_keys(names_of(CompareSpec)))


def _flat_record(old: dict) -> dict:
    """A compare record as today's flat keys: one written before the conversion keys were flat
    holds them under `conversion`."""
    nested = old.get("conversion")
    if not isinstance(nested, dict):
        return old
    return {**nested, **{k: v for k, v in old.items() if k != "conversion"}}


@dataclass
class RunResult:
    name: str
    num_kv_heads: int
    pooling: str
    eval_loss_before: float
    eval_loss_after: float
    uptrain_tokens: int
    # The KV cache a generated token adds: an encoder–decoder's decoder self-attention's alone, as
    # `uptrain inspect` and `uptrain train` count it (its cross-attention's is per source position,
    # `cross_kv_cache_bytes_per_source_token`); a latent's (MLA) latent and rotary key, every layer.
    kv_cache_bytes_per_token: int
    curve: list[tuple[int, float]]  # (tokens seen, eval loss)
    # `measure_speed`'s result at this G, measured once per G after the runs (speed-g{G}.json);
    # None in result.json, which is written before it, and with speed_repeats 0.
    speed: dict | None = None
    # Per --task, the uptrained checkpoint's score summary (`task_rows`, runs/NAME/tasks/); None in
    # result.json, which is written before it, and without --task.
    tasks: dict | None = None
    # A --kv-budget run's budget and allocation (None: a -g run, or MHA), the cost a calibrated one
    # minimised (uptrain.json's `allocation_cost`), and the converted attentions' KV heads layer by
    # layer as --kv-heads-per-layer spells them ("4,1,1,2,2,2"), read from the converted checkpoint;
    # `num_kv_heads` is then its config's scalar, the largest layer's.
    kv_budget: float | None = None
    allocation: str | None = None
    allocation_cost: str | None = None
    kv_heads_per_layer: str | None = None
    # An MLA run's (--target mla; None: GQA, MHA, and rows written before MLA runs): "mla", and its
    # latent read from the converted checkpoint, rank R and rotary columns D (KV elements per token
    # and layer R + D), the rotary key it was converted with and its --rope-stride and --rope-residual;
    # `pooling` holds its --mla-init, `num_kv_heads` is None (a latent has no KV heads) and `allocation` None.
    target: str | None = None
    kv_rank: int | None = None
    rope_dims: int | None = None
    rotary_key: str | None = None
    rope_stride: int | None = None
    rope_residual: int | None = None
    # An encoder–decoder's cross-attention KV bytes per source position (None: decoder-only, and rows
    # written before the split, whose `kv_cache_bytes_per_token` summed both).
    cross_kv_cache_bytes_per_source_token: int | None = None

    @property
    def perplexity_before(self) -> float:
        return float(torch.tensor(self.eval_loss_before).exp())

    @property
    def perplexity_after(self) -> float:
        return float(torch.tensor(self.eval_loss_after).exp())


def validate(spec: CompareSpec) -> None:
    """Every check of every run — each conversion's full `prepare` included — before any work."""
    if "wandb" in spec.report_to:
        from uptrain.train.tracking import ensure_wandb_never_prompts

        ensure_wandb_never_prompts()  # WANDB_MODE=online without a key: refused before compare.json
    if spec.uptrain_fraction is not None and spec.pretrain_tokens is None:  # the rule itself: CompareSpec
        spec.pretrain_tokens = pretrain_tokens(spec.model)
    spec.train_config(spec.model, Path(spec.output_dir) / "runs" / MHA / "train", MHA)  # its keys, now
    speed_setting(spec)  # the speed measurement's refusals too
    check_task_scoring(spec)  # and the task scoring's, on the model and every line of the task data
    for run in planned_runs(spec):
        if run.latent:
            # Another family than Llama's, or a budget no rank gives: refused here, as convert refuses it.
            checked_latent(run.conversion_spec(spec))
        elif run.converts:
            # A --kv-budget that no single G gives (uniform) or that no allocation reaches: refused here.
            prepare(run.conversion_spec(spec)).close()


@dataclass(frozen=True)
class PlannedRun:
    """One run of a compare: the MHA reference, a conversion to one G (-g), a conversion to a
    KV budget spent by an allocation (--kv-budget, --allocation), each with its pooling, or a
    conversion to a latent at a KV budget (--target mla), `pooling` holding its --mla-init."""

    name: str  # the run's folder under runs/ (and converted/)
    pooling: str
    num_kv_heads: int | None = None  # a -g run's G
    kv_budget: float | None = None  # a budget run's budget and allocation
    allocation: str | None = None
    latent: bool = False  # an MLA run

    @property
    def converts(self) -> bool:
        """Every run but the MHA reference converts the model."""
        return self.pooling != MHA

    @property
    def spends_budget(self) -> bool:
        return self.kv_budget is not None

    def conversion_spec(self, spec: CompareSpec):
        if self.latent:
            return spec.latent_conversion_spec(self.kv_budget, self.pooling)
        if not self.spends_budget:
            return spec.conversion_spec(self.num_kv_heads, self.pooling)
        return spec.budget_conversion_spec(self.kv_budget, self.allocation, self.pooling)

    def describe(self) -> str:
        if not self.converts:
            return "MHA reference"
        if not self.spends_budget:
            return f"G = {self.num_kv_heads}, {self.pooling} pooling"
        if self.latent:
            return f"KV budget {self.kv_budget:g}, MLA, {self.pooling} init"
        return f"KV budget {self.kv_budget:g}, {self.allocation} allocation, {self.pooling} pooling"


def planned_runs(spec: CompareSpec) -> list[PlannedRun]:
    """Every run in the order they run: MHA, each (G, pooling), then per budget each (allocation,
    pooling) of --target gqa and each MLA init of --target mla."""
    runs = [PlannedRun(MHA, MHA)]
    for g in spec.num_kv_heads:
        runs += [PlannedRun(f"g{g}-{p}", p, num_kv_heads=g) for p in spec.pooling]
    for budget in spec.kv_budget:
        for allocation in spec.allocation if "gqa" in spec.target else ():
            runs += [
                PlannedRun(f"b{budget:g}-{allocation}-{p}", p, kv_budget=budget, allocation=allocation)
                for p in spec.pooling
            ]
        for init in spec.mla_init if "mla" in spec.target else ():
            runs.append(PlannedRun(f"b{budget:g}-mla-{init}", init, kv_budget=budget, latent=True))
    return runs


def shared_calibration(prepared, root: Path, log=print) -> Calibration:
    """Attention-input moments of the source model on the train data, computed once per compare:
    every conversion of one compare reads the same model, text, tokens and block length. One
    file, moments and description together (in its metadata), so that no kill leaves one
    without the other; a damaged file is computed again."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import save_file

    path = root / CALIBRATION
    if path.exists():
        try:
            with safe_open(path, "pt") as f:
                info = parse_json((f.metadata() or {})["info"], str(path))
                # Layer numbers (decoder-only); an encoder–decoder's "{attention}.{layer}" keys.
                moments = {int(k) if k.isdigit() else k: f.get_tensor(k) for k in f.keys()}
            if (
                isinstance(info, dict)
                and moments
                and all(m.ndim == 2 and m.shape[0] == m.shape[1] for m in moments.values())
            ):
                return Calibration(moments, info)
        except (OSError, SafetensorError, UptrainError, KeyError, ValueError):
            pass
        log(f"[compare] {path} is damaged or incomplete; calibrating again")
    calibration = calibrate(prepared, progress=False, keep_moments=True)  # reused by every conversion
    with atomic_file(path) as tmp:
        save_file(
            {str(k): calibration.moments[k].contiguous() for k in calibration.moments},
            tmp,
            metadata={"info": json.dumps(calibration.info)},
        )
    (root / "calibration.json").unlink(missing_ok=True)  # where earlier compares kept the description
    return calibration


def kv_cache_bytes(shape: ModelShape, dtype_bytes: int, g: int | None, attentions=("decoder-self",)) -> dict:
    """A run's KV-cache bytes at G KV heads in `attentions` (the conversion's; G None: the model as
    it is), as RunResult's fields: per generated token (`kv_cache_bytes_per_token`: the decoder
    self-attention's; a latent attention's (MLA) latent and shared rotary key, every layer) and, for
    an encoder–decoder, its cross-attention's per source position (the encoder keeps no cache)."""
    if shape.latent_elements_per_token is not None:
        return {"kv_cache_bytes_per_token": shape.geometry.num_layers * shape.latent_elements_per_token * dtype_bytes}
    own = shape.geometry.kv_cache_bytes_per_token(dtype_bytes, g if "decoder-self" in attentions else None)
    if shape.cross is None:
        return {"kv_cache_bytes_per_token": own}
    cross = shape.cross.kv_cache_bytes_per_token(dtype_bytes, g if "cross" in attentions else None)
    return {"kv_cache_bytes_per_token": own, "cross_kv_cache_bytes_per_source_token": cross}


def _result(name: str, g: int, pooling: str, run_dir: Path, **fields) -> RunResult:
    """The run's row from its metrics; `fields`: its `kv_cache_bytes`, and a budget or MLA run's
    RunResult fields (kv_budget, …)."""
    records = read_metrics(run_dir / "metrics.jsonl")
    curve = [(r["train/tokens_seen"], r["eval/loss"]) for r in records if "eval/loss" in r]
    if not curve or curve[0][0] != 0:
        raise UptrainError(f"{run_dir}/metrics.jsonl lacks the step-0 evaluation")
    return RunResult(name, g, pooling, curve[0][1], curve[-1][1], curve[-1][0], curve=curve, **fields)


def converted_heads(shape: ModelShape, attentions: tuple[str, ...]) -> str:
    """A converted checkpoint's KV heads, layer by layer, of the attentions the compare converts
    (model order), as --kv-heads-per-layer spells them: "4,1,1,2,2,2", an encoder–decoder's "4,4/2,2"."""
    if shape.cross is None:  # a decoder-only model: its one attention, whatever --attention says
        attentions = ("decoder-self",)
    geometries = {"encoder": shape.encoder, "decoder-self": shape.geometry, "cross": shape.cross}
    return kv_heads_per_layer_text([list(geometries[a].layer_kv_heads()) for a in attentions])


def budget_fields(run: PlannedRun, converted: Path, attentions, dtype_bytes: int) -> dict:
    """What a budget run's row records of its conversion, read from the converted checkpoint: its
    config's scalar KV heads (the largest layer's), its KV bytes summed layer by layer
    (`kv_cache_bytes` on its own geometry, as `uptrain inspect` and `uptrain speed` count
    them), each layer's heads and the cost that chose them (uptrain.json)."""
    shape = model_shape(converted, run.name)
    record = read_json(converted / "uptrain.json")
    return {
        "num_kv_heads": shape.geometry.num_kv_heads,
        **kv_cache_bytes(shape, dtype_bytes, None),
        "kv_budget": run.kv_budget,
        "allocation": run.allocation,
        "allocation_cost": record.get("allocation_cost") if isinstance(record, dict) else None,
        "kv_heads_per_layer": converted_heads(shape, attentions),
    }


def latent_fields(run: PlannedRun, converted: Path, attentions, dtype_bytes: int) -> dict:
    """What an MLA run's row records of its conversion, read from the converted checkpoint: its
    rank and rotary columns (config.json), its rotary key, --rope-stride and --rope-residual
    (uptrain.json: the kept rotary frequencies 0, S, 2S, … and the residual ones among them) and its
    KV bytes per token (`kv_cache_bytes` on its latent, as `uptrain inspect` and `uptrain speed`
    count them)."""
    shape = model_shape(converted, run.name)
    config = read_config(converted)
    record = read_json(converted / "uptrain.json")
    record = record if isinstance(record, dict) else {}
    kept = record.get("rotary_frequencies_kept") or [0]  # one kept frequency: every stride keeps the same
    return {
        "num_kv_heads": None,
        **kv_cache_bytes(shape, dtype_bytes, None),
        "kv_budget": run.kv_budget,
        "target": "mla",
        "kv_rank": config["kv_lora_rank"],
        "rope_dims": config["qk_rope_head_dim"],
        "rotary_key": record.get("rotary_key"),
        "rope_stride": kept[1] - kept[0] if len(kept) > 1 else 1,
        "rope_residual": len(record.get("rotary_residual_frequencies") or ()),
    }


def _as_recorded(model: Path, train_dir: Path) -> Path:
    """`model` as the run's run_config.yaml names it, where that is the same folder: a resumed run
    refuses another `model`, and the compare's output_dir may be spelled otherwise now (`cmp`,
    `cmp/`, an absolute path) than when the run started."""
    from uptrain.options import read_yaml

    try:
        recorded = Path(read_yaml(train_dir / "run_config.yaml")["model"])
        if os.path.samefile(recorded, model):
            return recorded
    except (UptrainError, OSError, ValueError, TypeError, KeyError):
        pass  # no run yet, or a damaged record: the run itself says so
    return model


def _finished(path: Path, expected: dict, log) -> RunResult | None:
    """The row an earlier compare recorded for this run, or None to make it (again) from the run:
    absent, damaged (a kill cannot leave a part of one, but a full disk or a hand can), or not
    holding `expected` (RunResult fields: name, G, pooling, KV bytes; a budget run's budget, …)."""
    name = expected["name"]
    if not path.exists():
        return None
    # A record an older uptrain wrote (a field added or renamed since) reads as one that does not
    # fit: said so, not only "damaged", since upgrading is the likelier cause.
    stale = f"{path} is out of date or damaged"
    try:
        result = RunResult(**read_json(path))  # a list, or missing or unknown fields: TypeError
    except UptrainError as err:
        problem = str(err)  # parse_json's: the file and what is wrong with it
    except TypeError:
        problem = f"{stale} (not this uptrain's record of a run)"
    else:

        def number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        whole = (
            number(result.eval_loss_before)
            and number(result.eval_loss_after)
            and isinstance(result.uptrain_tokens, int)
            and isinstance(result.curve, list)
            and result.curve
            and all(isinstance(p, list) and len(p) == 2 and all(map(number, p)) for p in result.curve)
        )
        if whole and all(getattr(result, k) == v for k, v in expected.items()):
            return result
        problem = f"{stale} (it does not hold this run's values)"
    log(f"[compare] {name}: {problem}; making it again from the run")
    return None


def _start(spec: CompareSpec, root: Path) -> str:
    """Under the folder's lock: clear what killed compares left, refuse an earlier compare made
    with other settings (or a folder of something else), empty the folder for --overwrite, and
    record this compare in compare.json. Returns the compare's wandb group."""
    for folder in (root, root / "converted", *(root / "runs").glob("*")):
        if folder.is_dir() and not folder.is_symlink():
            remove_temporaries(folder)  # every writer here is a compare, and this one holds the lock
    if (root / "converted").is_dir():
        remove_stale_locks(root / "converted")  # of conversions killed before they let go
    contents = [p for p in root.iterdir() if p.name != LOCK_FILE]
    record, group = root / RECORD, None
    if spec.overwrite:
        for entry in contents:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    elif contents:
        if not record.is_file():
            raise UptrainError(
                f"output_dir {root} already holds files of something else (no {RECORD}); use "
                "another output_dir, or --overwrite to delete them"
            )
        try:
            old = read_json(record)
        except UptrainError as err:
            raise unreadable_record(str(err), "output_dir") from None
        if not isinstance(old, dict):
            raise unreadable_record(f"{record} is damaged (not a JSON object)", "output_dir")
        resume_rule().check(_flat_record(old), spec.to_dict(), what=f"the compare in {root}", place="output_dir")
        # An earlier compare's runs are in its group; one recorded before groups were, in the folder's name.
        group = old.get("wandb_group") if isinstance(old.get("wandb_group"), str) else root.name
    # Unique per compare: two folders of one name (or one folder emptied by --overwrite) never share a group.
    group = group or f"{root.name}-{secrets.token_hex(4)}"
    write_file(record, json.dumps({**spec.to_dict(), "wandb_group": group}, indent=2) + "\n")
    return group


def recorded_group(root: str | Path) -> str | None:
    """The wandb group compare.json records for the compare in `root` (None without one)."""
    try:
        group = read_json(Path(root) / RECORD).get("wandb_group")
    except (UptrainError, AttributeError):
        return None
    return group if isinstance(group, str) else None


_held: dict[Path, str] = {}  # the compare folders this process holds → their wandb groups


@contextmanager
def hold_compare_dir(spec: CompareSpec) -> Iterator[str]:
    """Check the whole compare (`validate`), refuse an output_dir that is, lies in or holds one
    of its inputs, take the folder's lock (a second compare, or a `uptrain train`, at it is
    refused at once) and check what an earlier compare left (`_start`): all before the first
    write. Yields the compare's wandb group. `run_compare` holds it; `uptrain compare` holds it
    around the report too (entered again, the lock is not taken twice)."""
    root = Path(spec.output_dir).absolute()
    if root in _held:
        yield _held[root]
        return
    validate(spec)
    check_apart(
        root,
        [("model", Path(spec.model)), ("`train_data`", Path(spec.train_data)), ("`eval_data`", Path(spec.eval_data))]
        + [("`task_data`", Path(data)) for data in spec.task_data],
        "output_dir",
    )
    with hold_run_dir(root):
        _held[root] = _start(spec, root)
        try:
            yield _held[root]
        finally:
            del _held[root]


def run_compare(spec: CompareSpec, log=print) -> list[RunResult]:
    """Run (or pick up) every run of the comparison; returns the MHA row first."""
    with hold_compare_dir(spec) as group:
        return _run_compare(spec, group, log)


def _run_compare(spec: CompareSpec, group: str, log) -> list[RunResult]:
    from uptrain.train.loop import run_training

    # One summary per run from wandb would bury the comparison; wandb still records everything.
    os.environ.setdefault("WANDB_SILENT", "true")
    root = Path(spec.output_dir)
    shape = model_shape(Path(spec.model), spec.model)
    attentions = parse_attention(spec.attention)
    dtype_bytes = DTYPE_BYTES.get(config_dtype(read_config(spec.model)), 4)
    results = []
    for run in planned_runs(spec):
        name, g, pooling = run.name, run.num_kv_heads, run.pooling
        run_dir = root / "runs" / name
        model = root / "converted" / name if run.converts else Path(spec.model)
        if run.latent:
            expected = {"name": name, "pooling": pooling, "kv_budget": run.kv_budget, "target": "mla"}
            if model.exists():
                expected.update(latent_fields(run, model, attentions, dtype_bytes))
        elif run.spends_budget:
            # Its heads are known once converted (a calibrated allocation is chosen then): a finished
            # row is checked against its conversion where that is still there.
            expected = {"name": name, "pooling": pooling, "kv_budget": run.kv_budget, "allocation": run.allocation}
            if model.exists():
                expected.update(budget_fields(run, model, attentions, dtype_bytes))
        else:
            g_eff = shape.geometry.num_kv_heads if g is None else g
            kv_bytes = kv_cache_bytes(shape, dtype_bytes, g, attentions)
            expected = {"name": name, "num_kv_heads": g_eff, "pooling": pooling, **kv_bytes}
        earlier = _finished(run_dir / RESULT, expected, log)
        if earlier is not None and (earlier.cross_kv_cache_bytes_per_source_token is None) != (shape.cross is None):
            # An encoder–decoder's row written before its caches were apart, its conversion gone: made again.
            log(f"[compare] {name}: {run_dir / RESULT} sums both caches' KV bytes; making it again from the run")
            earlier = None
        if earlier is not None:
            log(f"[compare] {name}: finished earlier, reusing {run_dir / RESULT}")
            results.append(earlier)
            continue
        log(f"[compare] {name}: {run.describe()}")
        if run.latent and not model.exists():
            model.parent.mkdir(parents=True, exist_ok=True)
            # One pass, calibrating on the training data itself where its init asks (`convert_mla`).
            convert_mla(run.conversion_spec(spec), model, progress=False)
        elif run.converts and not model.exists():
            model.parent.mkdir(parents=True, exist_ok=True)
            with prepare(run.conversion_spec(spec), model) as prepared:
                calibration = shared_calibration(prepared, root, log) if prepared.needs_calibration else None
                if prepared.conversion.pending_budget is not None:
                    # A calibrated allocation, the moments read from the shared file: chosen here.
                    settle_allocation(prepared, calibration)
                execute(prepared, model, calibration=calibration, progress=False)
        run_training(spec.train_config(_as_recorded(model, run_dir / "train"), run_dir / "train", name, group))
        if run.spends_budget:
            fields = (latent_fields if run.latent else budget_fields)(run, model, attentions, dtype_bytes)
            g_eff = fields.pop("num_kv_heads")
            result = _result(name, g_eff, pooling, run_dir / "train", **fields)
        else:
            result = _result(name, g_eff, pooling, run_dir / "train", **kv_bytes)
        write_file(run_dir / RESULT, json.dumps(asdict(result), indent=2) + "\n")
        results.append(result)
    return with_tasks(spec, with_speed(spec, results, log), log)
