"""The uptraining loop on Accelerate: one CPU, one GPU, or many processes under `accelerate launch`.

setup: check the models and data, start the run folder (converting `source` into it, see
`SourceConversion`), load and prepare the models, fix the `Plan` → resume the `Progress` of a
checkpoint → evaluate at step 0 → train with evaluation and checkpoints → evaluate → save `final/`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

import uptrain
import uptrain.modeling  # noqa: F401  registers gpt2_gqa, … with transformers' Auto classes
from uptrain import UptrainError
from uptrain.architecture import auto_class_name, config_geometry
from uptrain.budgets import pretrain_tokens
from uptrain.checkpoint.atomic import check_apart
from uptrain.checkpoint.source import resolve_source
from uptrain.convert.pipeline import calibrate, execute, prepare
from uptrain.model_info import DTYPE_BYTES, config_dtype, read_config
from uptrain.objectives import IGNORE_INDEX
from uptrain.textdata import TokenBlocks, load_blocks
from uptrain.train import metrics as M
from uptrain.train.checkpoint import CHECKPOINTS, checkpoint_name, load_checkpoint, load_data_state, save_checkpoint
from uptrain.train.config import TrainConfig
from uptrain.train.data import StreamedTrainBlocks, TrainBlocks, eval_batches
from uptrain.train.distributed import MainProcessWait, make_accelerator, place_teacher, teacher_dtype
from uptrain.train.packing import DocumentPacking, check_document_mask
from uptrain.train.pairs import load_pairs, pair_eval_batches
from uptrain.train.rundir import RunStart, hold_run_dir, initialise_run_dir, inspect_run_dir
from uptrain.train.seq2seq import (
    PAIR_OBJECTIVES,
    Objective,
    block_length,
    objective_for,
    resolve_objective,
    target_counts,
)
from uptrain.train.seq2seq import train_flops_per_token as seq2seq_flops
from uptrain.train.tracking import ensure_wandb_never_prompts, run_config, start_trackers

ETA_AFTER_STEPS = 3  # the first steps include warm-up costs; estimate from a few more
StepCallback = Callable[[int, dict], None]


def lr_at(config: TrainConfig, step: int, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (from 0): linear warmup, then cosine to min_lr_ratio·lr."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return config.lr * (config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine)


def _mixed_precision(config: TrainConfig) -> str | None:
    if config.mixed_precision != "auto":
        return config.mixed_precision
    if os.environ.get("ACCELERATE_MIXED_PRECISION"):
        return None  # `accelerate launch --mixed_precision …` decides
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"


def _load_tokenizer(path: str, what: str):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as err:
        raise UptrainError(
            f"{what} {path} has no usable tokenizer: {type(err).__name__}: "
            f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        ) from None
    if tokenizer.eos_token_id is None:
        raise UptrainError(f"the tokenizer of {what} {path} has no EOS token to join documents with")
    return tokenizer


def _check_same_tokenizer(student, teacher, teacher_path: str) -> None:
    if student.get_vocab() != teacher.get_vocab():
        s, t = student.get_vocab(), teacher.get_vocab()
        only = sorted(set(t) ^ set(s))[:3]
        detail = f"tokens in one only, e.g. {only}" if only else "the same tokens map to different ids"
        raise UptrainError(
            f"teacher {teacher_path} uses another tokenizer ({len(t)} vs {len(s)} tokens; {detail}); "
            "distillation compares logits token by token and needs the same tokenizer"
        )
    if student.eos_token_id != teacher.eos_token_id:
        raise UptrainError(
            f"teacher {teacher_path} uses another EOS token ({teacher.eos_token_id} vs {student.eos_token_id})"
        )


def _model_positions(config: dict) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if isinstance(config.get(key), int):
            return config[key]
    return None


def _human(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.4g}"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}"


@dataclass(frozen=True)
class Plan:
    """What the run is, decided by `setup` before the first step and fixed to the end. A resumed
    attempt makes the same plan: `inspect_run_dir` refuses a changed config or global batch."""

    config: TrainConfig
    out: Path
    model_path: str  # the model trained: `model`, or OUTPUT_DIR/converted under `source`
    total_steps: int
    tokens_per_step: int
    flops_per_token: float
    peak_flops: float | None
    static_metrics: dict  # model/… metrics, logged at step 0 and at the end
    source_dtype: str  # the dtype final/ writes tensors the starting checkpoint lacked in
    eval_block_count: int  # over all processes
    notes: tuple[str, ...] = ()  # printed above the plan
    objective: str = "causal"


@dataclass
class Progress:
    """How far the run has come: the only part of a run that changes as it trains."""

    start_step: int = 0  # where this attempt began: 0, or the step of the checkpoint it resumed from
    step: int = 0  # optimizer steps done
    tokens_seen: int = 0
    checkpoint_step: int | None = None  # the last checkpoint written or resumed from


@dataclass
class Run:
    """A run being trained: its plan, what it trains with, and its progress."""

    plan: Plan
    start: RunStart
    accelerator: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    teacher: torch.nn.Module | None
    train_blocks: TrainBlocks | StreamedTrainBlocks
    eval_set: list  # (batch, counted rows) pairs
    objective: Objective
    log: M.MetricsLog | None  # main process only
    progress: Progress = field(default_factory=Progress)
    packing: DocumentPacking | None = None  # document_mask: the forward's inputs that keep documents apart


class SourceConversion:
    """`source` + `num_kv_heads`: the run converts its starting model into OUTPUT_DIR/converted,
    with the pipeline of `uptrain convert` (calibrated on train_data when the conversion needs it).

    Two halves, because the run folder is started between them: building this runs `prepare`
    (headers and config only) on every process, before anything is written; `execute`
    calibrates and writes, on the main process, after `initialise_run_dir` (which empties the
    folder under --overwrite). converted/ is written whole or not at all, so an attempt that
    finds converted/config.json and keeps the folder (a resume) converts nothing again."""

    def __init__(self, config: TrainConfig, out: Path):
        self.config = config
        self.folder = out / "converted"
        reuse = (self.folder / "config.json").is_file() and not config.overwrite
        self.prepared = None if reuse else prepare(config.conversion_spec())

    @property
    def checked_folder(self) -> Path:
        """Where the model's tokenizer and positions are checked before converted/ exists: the source's."""
        return self.folder if self.prepared is None else Path(self.prepared.source.folder)

    def execute(self, accelerator) -> None:
        """Main process only, once the run folder is initialised."""
        if self.prepared is None:
            return
        accelerator.print(
            f"converting {self.config.source} to {self.config.num_kv_heads} KV heads "
            f"({self.config.pooling}) → {self.folder}"
        )
        execute(self.prepared, str(self.folder), calibration=calibrate(self.prepared), progress=False)

    def __enter__(self) -> SourceConversion:
        return self

    def __exit__(self, *exc) -> None:
        if self.prepared is not None:
            self.prepared.close()  # the source checkpoint, held open since `prepare`


def setup(config: TrainConfig) -> Run:
    """Check everything that can be checked before a write, start the run folder (converting
    `source` into it), then load the models and fix the plan."""
    notes = []
    if "wandb" in config.trackers and (note := ensure_wandb_never_prompts()):
        notes.append(note)
    # Refuses a launch that cannot do what it says (processes that did not join one run, FSDP or
    # DeepSpeed asked for where accelerate falls back) before anything is written.
    accelerator = make_accelerator(
        config.collective_timeout_s,
        gradient_accumulation_steps=config.grad_accum,
        mixed_precision=_mixed_precision(config),
        log_with=config.trackers or None,
    )
    world = accelerator.num_processes
    global_batch = config.batch_size * config.grad_accum * world
    out = Path(config.output_dir).absolute()

    # Every check that can fail on bad input runs before anything is written to output_dir, so a
    # corrected command can simply be run again. Every process reaches the same decision.
    # Local folders, or Hub ids downloaded (or found in the cache) as `uptrain convert` does.
    model_path = str(resolve_source(config.model).folder) if config.model is not None else None
    teacher_path = str(resolve_source(config.teacher).folder) if config.teacher is not None else None
    _fill_known_budget(config)
    if config.compile:
        check_compile_backend(config.compile_backend)
    start = inspect_run_dir(config, global_batch)
    conversion = SourceConversion(config, out) if config.source is not None else None
    with conversion if conversion is not None else contextlib.nullcontext():
        # The converted model's tokenizer and positions are the source's.
        checked = model_path if conversion is None else str(conversion.checked_folder)
        tokenizer, model_config, teacher_config = _check_models(config, checked, teacher_path)
        objective = _objective(config, checked, tokenizer, model_config, teacher_config)
        train_blocks, eval_set = _load_data(
            config, accelerator, tokenizer, global_batch, objective, checked, model_config
        )
        accelerator.wait_for_everyone()
        # The conversion runs on the main process alone, for minutes to hours: the others wait for
        # it at a barrier with its own timeout (conversion_timeout_s), not the collectives' one.
        converted = MainProcessWait(accelerator, config.conversion_timeout_s, "the conversion of `source`")
        if accelerator.is_main_process:
            initialise_run_dir(config, start, _run_info(start, world, global_batch))
            if conversion is not None:
                conversion.execute(accelerator)
    converted.wait()
    if conversion is not None:
        model_path, model_config = str(conversion.folder), read_config(conversion.folder)  # the converted KV heads

    model, optimizer, teacher, flops = _build_models(
        config, accelerator, model_path, model_config, teacher_path, teacher_config, objective
    )
    plan = _make_plan(config, accelerator, out, model_path, model_config, flops, eval_set, notes, objective.name)
    return Run(
        plan=plan,
        start=start,
        accelerator=accelerator,
        model=model,
        optimizer=optimizer,
        teacher=teacher,
        train_blocks=train_blocks,
        eval_set=eval_set,
        objective=objective,
        log=M.MetricsLog(out / "metrics.jsonl") if accelerator.is_main_process else None,
        packing=DocumentPacking.for_model(accelerator.unwrap_model(model), tokenizer.eos_token_id)
        if config.document_mask
        else None,
    )


def _make_plan(
    config: TrainConfig,
    accelerator,
    out: Path,
    model_path: str,
    model_config: dict,
    flops_per_token: float,
    eval_set: list,
    notes: list[str],
    objective: str,
) -> Plan:
    world = accelerator.num_processes
    geometry = config_geometry(model_config)
    source_dtype = config_dtype(model_config)
    local_eval_blocks = torch.tensor(sum(int(c.sum()) for _, c in eval_set), device=accelerator.device)
    return Plan(
        config=config,
        out=out,
        model_path=model_path,
        total_steps=config.total_steps(world),
        tokens_per_step=config.tokens_per_step(world),
        flops_per_token=flops_per_token,
        peak_flops=config.peak_flops or M.default_peak_flops(accelerator.device),
        static_metrics={
            "model/num_kv_heads": geometry.num_kv_heads,
            **M.kv_cache_metrics(model_config, DTYPE_BYTES.get(source_dtype, 4)),
        },
        source_dtype=source_dtype,
        notes=tuple(notes),
        objective=objective,
        eval_block_count=int(accelerator.reduce(local_eval_blocks, reduction="sum")),
    )


def _run_info(start: RunStart, world: int, global_batch: int) -> dict:
    """run.json of a fresh run (a resumed one keeps its own): the facts fixed at its start."""
    return {
        "wandb_run_id": start.info.get("wandb_run_id") or secrets.token_hex(4),
        "num_processes": world,
        "global_batch": global_batch,
        "started": start.info.get("started") or datetime.now(UTC).isoformat(timespec="seconds"),
        "uptrain_version": uptrain.__version__,
    }


def _build_models(
    config: TrainConfig,
    accelerator,
    model_path: str,
    model_config: dict,
    teacher_path: str | None,
    teacher_config: dict | None,
    objective: Objective,
):
    """The student, its optimizer and the teacher, prepared by accelerate; and the training FLOPs
    per token of the pair. Returns (model, optimizer, teacher or None, flops per token)."""
    from accelerate.utils import set_seed

    set_seed(config.seed)
    model = _load_model(model_path, "model", auto_class=auto_class_name(model_config))
    # from_pretrained returns the model in eval mode, and a resumed run skips the step-0
    # evaluation that switches it back: without this its dropout would be off until the next one.
    model.train()
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    flops = _flops_per_token(config, model, model_config, objective)
    teacher = None
    if config.teacher is not None:
        # Loaded straight in the dtype it is held in: no fp32 copy of a 7B teacher in host memory.
        teacher = _load_model(
            teacher_path, "teacher", teacher_dtype(accelerator), auto_class=auto_class_name(teacher_config)
        )
        teacher = teacher.requires_grad_(False).eval()
        flops += _flops_per_token(config, teacher, teacher_config, objective) / 3  # forward only
    optimizer = torch.optim.AdamW(
        _param_groups(model, config.weight_decay),
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        fused=fused_adamw(config.fused_adamw, accelerator.device),
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    if config.compile:
        compile_blocks(accelerator.unwrap_model(model), config.compile_backend)
    if teacher is not None:
        # A frozen teacher needs no fp32 master copy: under autocast it computes in bf16/fp16 anyway.
        # Under FSDP2 it is sharded like the student rather than copied whole to every GPU.
        teacher = place_teacher(accelerator, teacher)
    return model, optimizer, teacher, flops


def fused_adamw(setting: str | bool, device: torch.device) -> bool | None:
    """AdamW's `fused` argument for `fused_adamw` on `device`. None leaves torch's default: on CPU
    the single-tensor loop every earlier run used (so CPU results stay bit-identical), on CUDA
    foreach. The parameters are still on the CPU when the optimizer is built (accelerate's
    prepare moves them), so the choice is made from the device they will train on."""
    if setting == "auto":
        return True if device.type == "cuda" else None
    if setting and device.type not in ("cuda", "cpu"):
        raise UptrainError(f"fused_adamw: true runs on CUDA and CPU, not on {device.type}; use auto or false")
    return setting


def check_compile_backend(backend: str) -> None:
    """Refuse an unknown torch.compile backend before anything is written."""
    known = torch.compiler.list_backends(exclude_tags=())
    if backend not in known:
        raise UptrainError(
            f"compile_backend {backend!r} is not a torch.compile backend (e.g. "
            f"{', '.join(torch.compiler.list_backends())}, aot_eager, eager)"
        )


def compile_blocks(model: torch.nn.Module, backend: str) -> int:
    """torch.compile the repeated blocks of `model` in place (every member of a ModuleList whose
    members share one class: the decoder layers, T5's encoder and decoder blocks); a model without
    any is compiled whole, in place. Returns how many modules were compiled.

    Why so: in place (`Module.compile`), the module tree, and so every state-dict name, stays as
    it was (`torch.compile(model)` would wrap it and prefix `_orig_mod.`): accelerate's
    checkpoints and final/ hold the plain names whether or not the run compiled, and a resume may
    switch `compile` either way. Per block: one compiled layer's code serves every layer (compile
    time of one layer, not of N), and FSDP2's per-block hooks stay outside the compiled regions
    (accelerate's regional compilation does the same). After prepare, not through accelerate's
    dynamo plugin: DDP and FSDP wrap the eager model and the accelerator is built the same way
    with or without compile. Gradient checkpointing works wherever transformers puts it (around
    the block's call in 5.17, inside its forward later: dynamo traces non-reentrant checkpoints);
    evaluation (eval mode, no grad) compiles once more, then reuses that."""
    blocks = list(_repeated_blocks(model))
    for block in blocks or [model]:
        block.compile(backend=backend)
    return len(blocks) or 1


def _repeated_blocks(module: torch.nn.Module):
    if isinstance(module, torch.nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
        yield from module  # the outermost repetition only: a block's own lists are compiled with it
        return
    for child in module.children():
        yield from _repeated_blocks(child)


def _flops_per_token(config: TrainConfig, model: torch.nn.Module, model_config: dict, objective: Objective) -> float:
    """Forward + backward FLOPs per counted token; counted before accelerate wraps or shards the parameters."""
    if objective.name != "causal":
        return seq2seq_flops(model, model_config, objective.name, config.seq_len, config.target_len or config.seq_len)
    geometry = config_geometry(model_config)
    width = geometry.num_heads * geometry.head_dim
    return M.train_flops_per_token(M.non_embedding_params(model), geometry.num_layers, width, config.seq_len)


def _fill_known_budget(config: TrainConfig) -> None:
    """`uptrain_fraction` without `pretrain_tokens`: the model's own budget (`budgets.pretrain_tokens`)."""
    if config.uptrain_fraction is not None and config.pretrain_tokens is None:
        config.pretrain_tokens = pretrain_tokens(config.source if config.source is not None else config.model)


def _check_models(config: TrainConfig, model_path: str, teacher_path: str | None):
    """Positions, tokenizer and teacher compatibility. Returns (tokenizer, model config, teacher config)."""
    model_config = read_config(model_path)
    positions = _model_positions(model_config)
    if positions is not None and config.seq_len > positions:
        raise UptrainError(
            f"seq_len {config.seq_len} is beyond the model's {positions} positions "
            f"(max_position_embeddings of {model_path})"
        )
    tokenizer = _load_tokenizer(model_path, "model")
    if config.document_mask:
        check_document_mask(model_config, config.seq_len, model_path)
    teacher_config = None
    if teacher_path is not None:
        teacher_config = read_config(teacher_path)
        _check_same_tokenizer(tokenizer, _load_tokenizer(teacher_path, "teacher"), config.teacher)
        if teacher_config.get("vocab_size") != model_config.get("vocab_size"):
            raise UptrainError(
                f"teacher {config.teacher} has vocab_size {teacher_config.get('vocab_size')}, the "
                f"model {model_config.get('vocab_size')}: their logits cannot be compared"
            )
    return tokenizer, model_config, teacher_config


def _objective(
    config: TrainConfig, model_path: str, tokenizer, model_config: dict, teacher_config: dict | None
) -> Objective:
    """The run's objective (`objective`, or the model family's) with the special tokens it needs."""
    name = resolve_objective(config.objective, model_config, model_path)
    if teacher_config is not None:  # the teacher must read the same inputs and score the same labels
        resolve_objective(name, teacher_config, f"teacher {config.teacher}")
    if config.target_len is not None and name not in PAIR_OBJECTIVES:
        raise UptrainError(f"`target_len` applies to objective pairs and speech_pairs, not {name}")
    if config.document_mask and name != "causal":
        raise UptrainError(f"document_mask applies to objective causal (packed documents), not {name}")
    return objective_for(name, config.seed, tokenizer, model_config, model_path, config.seq_len)


def _load_pair_data(config: TrainConfig, accelerator, tokenizer, global_batch, objective, model_path, model_config):
    """`pairs` / `speech_pairs`: every example of train_data and eval_data read and checked."""
    world, rank = accelerator.num_processes, accelerator.process_index
    common = dict(
        objective=objective.name,
        tokenizer=tokenizer,
        model_path=model_path,
        model_config=model_config,
        seq_len=config.seq_len,
        target_len=config.target_len or config.seq_len,
    )
    train = load_pairs(config.train_data, "train_data", **common)
    evaluation = load_pairs(config.eval_data, "eval_data", **common)
    if len(train) < global_batch:
        raise UptrainError(
            f"train_data gives {len(train)} examples; one optimizer step needs {global_batch} (batch_size "
            f"{config.batch_size} × grad_accum {config.grad_accum} × processes {world}): give more examples"
        )
    train_blocks = TrainBlocks(train, config.seed, config.batch_size, config.grad_accum, world)
    return train_blocks, pair_eval_batches(evaluation, config.eval_blocks, config.batch_size, rank, world)


def _load_data(
    config: TrainConfig,
    accelerator,
    tokenizer,
    global_batch: int,
    objective: Objective,
    model_path: str,
    model_config: dict,
):
    """Tokenized, packed training blocks (or examples) and this process's eval batches; refuses data too short."""
    if objective.name in PAIR_OBJECTIVES:
        return _load_pair_data(config, accelerator, tokenizer, global_batch, objective, model_path, model_config)
    world, rank = accelerator.num_processes, accelerator.process_index
    # Rank 0 tokenizes first so that the others read datasets' cache instead of redoing the work.
    with accelerator.main_process_first():
        common = dict(
            tokenizer=tokenizer,
            # The raw block that gives the model seq_len input tokens (span corruption drops tokens).
            seq_len=block_length(objective.name, config.seq_len),
            text_field=config.text_field,
            sample_by=config.sample_by,
            streaming=config.streaming,
            workers=config.data_workers,
        )
        train_data, train_source = load_blocks(
            config.train_data, "train_data", split=config.train_split, dataset_config=config.dataset_config, **common
        )
        eval_data, eval_source = load_blocks(
            config.eval_data,
            "eval_data",
            split=config.eval_split,
            dataset_config=config.eval_dataset_config or config.dataset_config,
            **common,
        )
    too_short = (
        f"give more text or a smaller seq_len / batch (global batch: batch_size {config.batch_size} × "
        f"grad_accum {config.grad_accum} × processes {world})"
    )
    if isinstance(train_data, TokenBlocks):
        if len(train_data) < global_batch:
            raise UptrainError(
                f"train_data {train_source.label} gives {len(train_data)} blocks of {config.seq_len} "
                f"tokens; one optimizer step needs {global_batch}: {too_short}"
            )
        train_blocks = TrainBlocks(train_data, config.seed, config.batch_size, config.grad_accum, world)
    else:
        train_blocks = StreamedTrainBlocks(
            train_data, config.seed, config.batch_size, config.grad_accum, world, rank, config.data_workers or 1
        )
        # The head of the whole stream (as every process sees it): the same decision everywhere.
        available = sum(1 for _ in itertools.islice(iter(train_data), global_batch))
        if available < global_batch:
            raise UptrainError(
                f"train_data {train_source.label} gives {available} blocks of {config.seq_len} "
                f"tokens; one optimizer step needs {global_batch}: {too_short}"
            )
    eval_set = [
        (objective.eval_batch(rows), counted)
        for rows, counted in eval_batches(eval_data, config.eval_blocks, config.batch_size, rank, world)
    ]
    if not eval_set:
        raise UptrainError(
            f"eval_data {eval_source.label} gives no block of {config.seq_len} tokens: give more "
            "text or a smaller seq_len"
        )
    return train_blocks, eval_set


def _load_model(
    path: str, what: str, dtype: torch.dtype = torch.float32, auto_class: str = "AutoModelForCausalLM"
) -> torch.nn.Module:
    import transformers

    try:
        # fp32 master weights; autocast (mixed_precision) gives bf16 speed on GPUs.
        return getattr(transformers, auto_class).from_pretrained(path, dtype=dtype)
    except Exception as err:
        raise UptrainError(
            f"cannot load {what} {path} with {auto_class}: {type(err).__name__}: "
            f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        ) from None


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    # Decay matrices only: decaying norm scales and biases towards 0 fights what they encode.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


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
    """One optimizer step (`step` counted from 0). Returns the step's metrics; does not update the
    weights if the loss or gradient norm is not finite."""
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
                    return {"train/loss": totals[0], "train/grad_norm": grad_norm, "train/lr": lr, "finite": False}
                run.optimizer.step()
                if not reported:  # DeepSpeed: its own clipping ran in the step; ask for the norm it saw
                    after = acc.clip_grad_norm_(run.model.parameters(), math.inf)
                    grad_norm = float(after) if after is not None else math.nan
                run.optimizer.zero_grad()
    record = {"train/loss": totals[0], "train/lr": lr, "train/grad_norm": grad_norm, "finite": True}
    if run.teacher is not None:
        record.update({"train/ce_loss": totals[1], "train/distill_kl": totals[2]})
    return record


def _log(run: Run, step: int, record: dict) -> None:
    record = {"step": step, **record}
    if run.log is not None:
        run.log.append(record)
    run.accelerator.log({k: v for k, v in record.items() if k != "step"}, step=step)


def _print_plan(run: Run) -> None:
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
    data = "streamed"
    if isinstance(run.train_blocks, TrainBlocks):
        epochs = plan.total_steps / run.train_blocks.steps_per_epoch
        data = f"{len(run.train_blocks.blocks)} blocks, {epochs:.3g} epochs over them"
    distill = "no"
    if c.teacher:
        distill = f"from {c.teacher} (weight {c.distill_weight}, temperature {c.distill_temperature})"
    total_tokens, left_tokens = plan.total_steps * plan.tokens_per_step, steps_left * plan.tokens_per_step
    resuming = f" (resuming after step {start_step}, {steps_left} left)" if start_step else ""
    lines = [
        "plan:",
        f"  model            {plan.model_path} ({plan.static_metrics['model/num_kv_heads']} KV heads, "
        f"{plan.static_metrics['model/kv_cache_bytes_per_token']} KV-cache bytes/token)",
        f"  budget           {budget}",
        f"  steps            {plan.total_steps}{resuming}",
        f"  tokens           {_human(total_tokens)} ({_human(left_tokens)} to go)",
        f"  tokens per step  {plan.tokens_per_step} = seq_len {c.seq_len} × batch_size {c.batch_size} × grad_accum "
        f"{c.grad_accum} × processes {acc.num_processes}",
        f"  processes        {acc.num_processes} ({acc.device.type}, mixed precision {acc.mixed_precision})",
        f"  train data       {data}; eval: the same {plan.eval_block_count} blocks each time",
        f"  objective        {plan.objective}",
        f"  distillation     {distill}",
        f"  output           {plan.out}",
    ]
    acc.print("\n".join([*plan.notes, *lines]))


def _save_final(run: Run, final_metrics: dict) -> Path:
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
        step = load_checkpoint(acc, run.start.checkpoint)["step"]
        run.train_blocks.load_state_dict(load_data_state(run.start.checkpoint, acc.process_index))
        run.progress = Progress(
            start_step=step, step=step, tokens_seen=step * plan.tokens_per_step, checkpoint_step=step
        )
        acc.print(f"resuming from {run.start.checkpoint} (step {step})")
    if run.log is not None:
        run.log.truncate_after(run.progress.start_step if run.progress.start_step else -1)
    _print_plan(run)

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
    try:
        result = _train(run, on_step)
    finally:
        acc.end_training()
    return result


def _train(run: Run, on_step: StepCallback | None) -> Path:
    acc, plan, progress = run.accelerator, run.plan, run.progress
    config = plan.config
    last_eval = None
    if progress.step == 0:
        last_eval = evaluate(run)
        _log(run, 0, {**last_eval, "train/tokens_seen": 0, **plan.static_metrics})
    bar = tqdm(
        total=plan.total_steps,
        initial=progress.step,
        desc="uptrain",
        unit="step",
        disable=not acc.is_main_process,
        dynamic_ncols=True,
    )
    timed_steps, timed_seconds = 0, 0.0
    with bar:
        while progress.step < plan.total_steps:
            t0 = time.perf_counter()
            record = train_step(run, progress.step)
            step_time = time.perf_counter() - t0
            progress.step += 1
            progress.tokens_seen += plan.tokens_per_step
            step = progress.step
            tokens_per_second = plan.tokens_per_step / step_time
            record.update(
                {
                    "train/tokens_seen": progress.tokens_seen,
                    "perf/tokens_per_second": tokens_per_second,
                    "perf/step_time_s": step_time,
                    "perf/data_wait_s": run.train_blocks.last_wait_s,
                    "perf/peak_memory_bytes": M.peak_memory_bytes(acc.device),
                }
            )
            if plan.peak_flops:
                record["perf/mfu"] = M.mfu(tokens_per_second, plan.flops_per_token, plan.peak_flops, acc.num_processes)
            if not record.pop("finite"):
                _log(run, step, record)
                where = (
                    f"last good checkpoint: {plan.out / CHECKPOINTS / checkpoint_name(progress.checkpoint_step)} "
                    f"(step {progress.checkpoint_step})"
                    if progress.checkpoint_step
                    else "no checkpoint was written before it"
                )
                raise UptrainError(
                    f"non-finite loss at step {step} (loss {record['train/loss']}, grad norm "
                    f"{record['train/grad_norm']}); stopped without applying it; {where}; "
                    "a lower lr or more warmup_steps may help"
                )
            evaluate_now = step % config.eval_every == 0 or step == plan.total_steps
            if evaluate_now:
                last_eval = evaluate(run)
                record.update(last_eval)
            if step == plan.total_steps:
                record.update(plan.static_metrics)
            if evaluate_now or step % config.log_every == 0 or step == plan.total_steps:
                _log(run, step, record)
            if step % config.save_every == 0 and step < plan.total_steps:
                save_checkpoint(
                    acc,
                    plan.out,
                    step,
                    {"step": step, "tokens_seen": progress.tokens_seen, "total_steps": plan.total_steps},
                    config.keep_checkpoints,
                    data_state=run.train_blocks.state_dict(),
                )
                progress.checkpoint_step = step
            bar.update(1)
            bar.set_postfix(loss=f"{record['train/loss']:.4f}", tok_s=f"{tokens_per_second:,.0f}", refresh=False)
            done_here = step - progress.start_step
            if done_here > 1:  # the first step pays for warm-up; leave it out of the estimate
                timed_steps, timed_seconds = timed_steps + 1, timed_seconds + step_time
            if done_here == ETA_AFTER_STEPS + 1 and step < plan.total_steps:
                per_step = timed_seconds / timed_steps
                bar.write(
                    f"estimated remaining: {_duration(per_step * (plan.total_steps - step))} "
                    f"({per_step:.3g} s/step, {plan.tokens_per_step / per_step:,.0f} tokens/s)"
                )
            if on_step is not None:
                on_step(step, record)
    final = _save_final(run, last_eval or {})
    acc.print(f"eval/loss {last_eval['eval/loss']:.4f} after {plan.total_steps} steps; uptrained model: {final}")
    return final
