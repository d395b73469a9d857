"""A run's setup, everything before its first step: check the models and data, start the run folder
(converting `source` into it, see `SourceConversion`), load and prepare the models, fix the `Plan`.

The `Run` it returns is what the loop trains: the frozen `Plan` beside the mutable `Progress`."""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import torch

import uptrain
import uptrain.modeling  # noqa: F401  registers gpt2_gqa, … with transformers' Auto classes
from uptrain import UptrainError
from uptrain.architecture import auto_class_name, block_positions, config_geometry, deepseek_v2, find_architecture
from uptrain.budgets import pretrain_tokens
from uptrain.checkpoint.source import resolve_source
from uptrain.convert.pipeline import calibrate, execute, prepare
from uptrain.data.batches import MicroBatches
from uptrain.data.document_mask import DocumentPacking, check_document_mask
from uptrain.data.objective_batches import ObjectiveBatches, objective_for, resolve_objective
from uptrain.loading import load_model, load_tokenizer
from uptrain.model_info import DTYPE_BYTES, config_dtype, read_config
from uptrain.objectives import key_problem
from uptrain.objectives.prompts import PromptKeys, target_framing
from uptrain.train import metrics as M
from uptrain.train.compile import check_compile_backend, compile_blocks
from uptrain.train.config import TrainConfig
from uptrain.train.distributed import MainProcessWait, make_accelerator, place_teacher, teacher_dtype
from uptrain.train.optimizer import adamw
from uptrain.train.run_data import load_run_data
from uptrain.train.rundir import RunStart, check_shared_run_dir, initialise_run_dir, inspect_run_dir
from uptrain.train.speech_units import SpeechUnits, speech_units
from uptrain.train.tracking import ensure_wandb_never_prompts


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
    speech: SpeechUnits | None = None  # a speech run's clips, audio seconds and decoder tokens


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
    train_blocks: MicroBatches
    eval_set: list  # (batch, counted rows) pairs
    objective: ObjectiveBatches
    log: M.MetricsLog | None  # main process only
    progress: Progress = field(default_factory=Progress)
    packing: DocumentPacking | None = None  # document_mask: the forward's inputs that keep documents apart


class SourceConversion:
    """`source` + `num_kv_heads` (or `kv_heads_per_layer`, `kv_budget`): the run converts its starting
    model into OUTPUT_DIR/converted, with the pipeline of `uptrain convert` (calibrated on train_data
    when the conversion needs it).

    Two halves, because the run folder is started between them: building this runs `prepare`
    (headers and config only) on every process, before anything is written; `execute`
    calibrates and writes, on the main process, after `initialise_run_dir` (which empties the
    folder under --overwrite). converted/ is written whole or not at all, so an attempt that
    finds converted/config.json and keeps the folder (a resume) converts nothing again."""

    def __init__(self, config: TrainConfig, out: Path):
        self.config = config
        self.folder = out / "converted"
        reuse = (self.folder / "config.json").is_file() and not config.overwrite
        spec = config.conversion_spec()
        # `target: mla` converts in one pass (`convert_mla`); its layout's refusals are checked here,
        # before anything is written, as `prepare` checks a GQA conversion's.
        from uptrain.convert.mla import checked_latent

        self.latent = None if reuse or spec.target != "mla" else (spec, checked_latent(spec))
        self.prepared = None if reuse or self.latent is not None else prepare(spec)

    @property
    def checked_folder(self) -> Path:
        """Where the model's tokenizer and positions are checked before converted/ exists: the source's."""
        if self.latent is not None:
            return Path(self.latent[1].folder)
        return self.folder if self.prepared is None else Path(self.prepared.source.folder)

    def execute(self, accelerator) -> None:
        """Main process only, once the run folder is initialised."""
        if self.latent is not None:
            from uptrain.convert.mla import convert_mla

            spec = self.latent[0]
            accelerator.print(
                f"converting {spec.source} to multi-head latent attention ({spec.mla_init}) → {self.folder}"
            )
            convert_mla(spec, self.folder, progress=False)
            return
        if self.prepared is None:
            return
        what = f"{self._kv_heads()} ({self.config.pooling})"
        accelerator.print(f"converting {self.config.source} to {what} → {self.folder}")
        execute(self.prepared, str(self.folder), calibration=calibrate(self.prepared), progress=False)

    def _kv_heads(self) -> str:
        """The KV heads asked for, as the run's keys chose them."""
        c = self.config
        if c.num_kv_heads is not None:
            return f"{c.num_kv_heads} KV heads"
        if c.kv_heads_per_layer is not None:
            return f"KV heads {c.kv_heads_per_layer} layer by layer"
        return f"a KV budget of {c.kv_budget:g} ({c.allocation} allocation)"

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
        train_blocks, eval_set = load_run_data(
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
    check_shared_run_dir(accelerator, config, start)  # one folder for every machine's processes
    if conversion is not None:
        model_path, model_config = str(conversion.folder), read_config(conversion.folder)  # the converted KV heads

    model, optimizer, teacher, flops = _build_models(
        config, accelerator, model_path, model_config, teacher_path, teacher_config, objective
    )
    plan = _make_plan(config, accelerator, out, model_path, model_config, flops, eval_set, notes, objective.name)
    if objective.objective.encoder_reads == "audio":  # counted in clips, not seq_len tokens
        arch = find_architecture(model_config.get("model_type"))
        plan = replace(plan, speech=speech_units(train_blocks.blocks, global_batch, model_config, arch))
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
            **M.attention_metrics(model_config),
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


def _mixed_precision(config: TrainConfig) -> str | None:
    if config.mixed_precision != "auto":
        return config.mixed_precision
    if os.environ.get("ACCELERATE_MIXED_PRECISION"):
        return None  # `accelerate launch --mixed_precision …` decides
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"


def _build_models(
    config: TrainConfig,
    accelerator,
    model_path: str,
    model_config: dict,
    teacher_path: str | None,
    teacher_config: dict | None,
    objective: ObjectiveBatches,
):
    """The student, its optimizer and the teacher, prepared by accelerate; and the training FLOPs
    per token of the pair. Returns (model, optimizer, teacher or None, flops per token)."""
    from accelerate.utils import set_seed

    set_seed(config.seed)
    # fp32 master weights (the loader's default); autocast (mixed_precision) gives bf16 speed on GPUs.
    model = load_model(model_path, "model", auto_class_name(model_config))
    # from_pretrained returns the model in eval mode, and a resumed run skips the step-0
    # evaluation that switches it back: without this its dropout would be off until the next one.
    model.train()
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    flops = _flops_per_token(config, model, model_config, objective)
    teacher = None
    if config.teacher is not None:
        # Loaded straight in the dtype it is held in: no fp32 copy of a 7B teacher in host memory.
        teacher = load_model(teacher_path, "teacher", auto_class_name(teacher_config), teacher_dtype(accelerator))
        teacher = teacher.requires_grad_(False).eval()
        flops += _flops_per_token(config, teacher, teacher_config, objective) / 3  # forward only
    optimizer = adamw(config, model, accelerator.device)
    model, optimizer = accelerator.prepare(model, optimizer)
    if config.compile:
        compile_blocks(accelerator.unwrap_model(model), config.compile_backend)
    if teacher is not None:
        # A frozen teacher needs no fp32 master copy: under autocast it computes in bf16/fp16 anyway.
        # Under FSDP2 it is sharded like the student rather than copied whole to every GPU.
        teacher = place_teacher(accelerator, teacher)
    return model, optimizer, teacher, flops


def _flops_per_token(
    config: TrainConfig, model: torch.nn.Module, model_config: dict, objective: ObjectiveBatches
) -> float:
    """Forward + backward FLOPs per counted token; counted before accelerate wraps or shards the parameters."""
    if objective.objective.encoder_decoder:
        target_len = config.target_len or config.seq_len
        return M.encoder_decoder_flops_per_token(model, model_config, objective.objective, config.seq_len, target_len)
    geometry = config_geometry(model_config)
    width = geometry.num_heads * geometry.head_dim
    if model_config.get("model_type") == deepseek_v2.MODEL_TYPE:
        width = deepseek_v2.attention_width(model_config)
    return M.train_flops_per_token(M.non_embedding_params(model), geometry.num_layers, width, config.seq_len)


def _fill_known_budget(config: TrainConfig) -> None:
    """`uptrain_fraction` without `pretrain_tokens`: the model's own budget (`budgets.pretrain_tokens`)."""
    if config.uptrain_fraction is not None and config.pretrain_tokens is None:
        config.pretrain_tokens = pretrain_tokens(config.source if config.source is not None else config.model)


def _check_models(config: TrainConfig, model_path: str, teacher_path: str | None):
    """Positions, tokenizer and teacher compatibility. Returns (tokenizer, model config, teacher config)."""
    model_config = read_config(model_path)
    positions, key = block_positions(model_config, model_path)
    if positions is not None and config.seq_len > positions:
        raise UptrainError(
            f"seq_len {config.seq_len} is beyond the model's {positions} positions ({key} of {model_path})"
        )
    tokenizer = load_tokenizer(model_path, "model")
    if config.document_mask:
        check_document_mask(model_config, config.seq_len, model_path)
    teacher_config = None
    if teacher_path is not None:
        teacher_config = read_config(teacher_path)
        _check_same_tokenizer(tokenizer, load_tokenizer(teacher_path, "teacher"), config.teacher)
        if teacher_config.get("vocab_size") != model_config.get("vocab_size"):
            raise UptrainError(
                f"teacher {config.teacher} has vocab_size {teacher_config.get('vocab_size')}, the "
                f"model {model_config.get('vocab_size')}: their logits cannot be compared"
            )
    return tokenizer, model_config, teacher_config


def _check_same_tokenizer(student, teacher, teacher_path: str) -> None:
    s, t = student.get_vocab(), teacher.get_vocab()
    if s != t:
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


def _objective(
    config: TrainConfig, model_path: str, tokenizer, model_config: dict, teacher_config: dict | None
) -> ObjectiveBatches:
    """The run's objective (`objective`, or the model family's) with the special tokens it needs."""
    objective = resolve_objective(config.objective, model_config, model_path)
    if teacher_config is not None:  # the teacher must read the same inputs and score the same labels
        resolve_objective(objective.name, teacher_config, f"teacher {config.teacher}")
    if problem := key_problem(objective, config.target_len, config.document_mask):
        raise UptrainError(problem)
    batches = objective_for(objective, config.seed, tokenizer, model_config, model_path, config.seq_len)
    keys = PromptKeys(config.language, config.speech_task, config.source_lang, config.target_lang)
    arch = find_architecture(model_config.get("model_type"))
    framing = target_framing(arch, objective, keys, tokenizer, model_path, model_config)
    return replace(batches, framing=framing)
