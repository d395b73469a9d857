"""The `uptrain train` configuration: one validated schema, read from YAML and overridden by flags.

Every key is a YAML key and a `--flag` of the same name (`--seq_len` or `--seq-len`); its help is
the `--help` text. Unknown keys are refused so that a typo never silently falls back to a default.
The schema is `uptrain.options`' like every command's, built from groups of keys: the conversion
keys (`ConversionOptions`, applied when `source` is converted on the fly), the data, the step,
the optimizer, the budget (`UptrainingBudget`), distillation, how the steps run, reporting and
timeouts, then the keys of one run. `uptrain compare` embeds the same groups (bounds and checks
included) and builds each of its runs' `TrainConfig` from them.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from uptrain.budgets import UptrainingBudget
from uptrain.convert.kv_heads import allocation_cost_problem, cross_kv_weight_problem, kv_heads_problem
from uptrain.convert.spec import (
    Allocation,
    AllocationCost,
    ConversionOptions,
    ConversionSpec,
    MLAInit,
    RotaryKey,
    Target,
    allocation_cost_option,
    allocation_option,
    conversion_spec,
    cross_kv_weight_option,
    kv_budget_option,
    kv_heads_option,
    kv_heads_per_layer_option,
    merge_key_problems,
    seed_option,
)
from uptrain.options import (
    MAX_CONFIG_BYTES,
    Schema,
    add_schema_arguments,
    from_args,
    load,
    names_of,
    option,
    option_like,
    validated_values,
)

__all__ = [
    "MAX_CONFIG_BYTES",
    "OPERATIONAL_KEYS",
    "TrainConfig",
    "add_config_arguments",
    "config_from_args",
    "config_to_yaml",
    "load_config",
    "validated_config",
]

Reporter = Literal["wandb", "jsonl", "none"]


def objectives() -> dict[str, str]:
    """The registered objectives and what each learns (imports torch: asked only when a value is
    checked or `--help` is built)."""
    from uptrain.objectives import objective_choices

    return objective_choices()


def _names_data(value: str) -> str | None:
    return None if value else "must name at least one file or dataset"


@dataclass(kw_only=True)
class TrainData(Schema):
    """What the model reads: training and evaluation text, how it is read, what is learnt from it."""

    train_data: str | list[str] = option(
        check=_names_data,
        help="training text: local .txt/.jsonl/.json/.parquet file(s) or folder, or a datasets Hub name (streamed)",
    )
    eval_data: str | list[str] = option(
        check=_names_data,
        help="evaluation text, same forms as `train_data`; the same blocks are scored at every evaluation",
    )
    dataset_config: str | None = option(None, help="configuration name of a Hub `train_data` (e.g. sample-10BT)")
    eval_dataset_config: str | None = option(
        None, help="configuration name of a Hub `eval_data` (default: dataset_config)"
    )
    train_split: str = option("train", help="split of a Hub `train_data`")
    eval_split: str = option("validation", help="split of a Hub `eval_data` (local files have only `train`)")
    text_field: str = option("text", help="column holding the text in jsonl/parquet/Hub datasets")
    sample_by: Literal["line", "paragraph", "document"] = option(
        "paragraph", help="what one document is in a .txt file; documents are joined with EOS"
    )
    streaming: bool | None = option(
        None,
        help="stream the data instead of tokenizing it all up front (default: true for Hub names, false for local "
        "files)",
    )
    objective: str | None = option(
        None,
        choices=objectives,
        help="what the model learns; default: the architecture's own (`default_objective` of its record in "
        "uptrain/architecture; causal for models without an encoder)",
    )
    target_len: int | None = option(
        None,
        at_least=1,
        help="most target tokens of a pairs/speech_pairs example (longer are cut); default: seq_len",
    )
    language: str | None = option(
        None,
        help="Whisper (speech_pairs): the audio's language (en, fr, english, <|en|>), whose token opens every "
        "target as `generate(language=…)` forces it; default: the generation config's (or the tokenizer's); a "
        "multilingual checkpoint that names none needs it, an English-only one takes none",
    )
    speech_task: Literal["transcribe", "translate"] | None = option(
        None,
        help="Whisper (speech_pairs): the task token after the language, as `generate(task=…)` forces it (default: "
        "the generation config's or the tokenizer's, else transcribe; not `task`, which is compare's evaluation)",
    )
    source_lang: str | None = option(
        None,
        help="mBART/M2M100/NLLB (pairs): the tokenizer's src_lang, the language code its sources carry (en_XX, "
        "eng_Latn; default: the tokenizer's saved one)",
    )
    target_lang: str | None = option(
        None,
        help="mBART/M2M100/NLLB (pairs): the tokenizer's tgt_lang, the code each target starts with as "
        "`generate(forced_bos_token_id=…)` forces it (default: the tokenizer's saved one); multilingual Marian: "
        "the `>>code<<` token written ahead of each source",
    )
    eval_blocks: int = option(
        64, at_least=1, help="most `seq_len` blocks (pairs: examples) of `eval_data` used for evaluation"
    )
    data_workers: int | None = option(
        None,
        at_least=1,
        help="processes that tokenize: for data tokenized up front in all; for streamed data, "
        "DataLoader workers per process, each reading its own share (default: 1)",
    )

    def problems(self) -> list[str]:
        found = super().problems()
        found += [
            f"`{name}`: must name at least one file or dataset"
            for name in ("train_data", "eval_data")
            if getattr(self, name) == []
        ]
        if self.objective is not None:  # a given one (the model's own is checked when the model is read)
            from uptrain.objectives import get_objective, key_problem

            found += [problem] if (problem := key_problem(get_objective(self.objective), self.target_len)) else []
        return found


@dataclass(kw_only=True)
class StepShape(Schema):
    """The shape of one optimizer step."""

    seq_len: int = option(
        at_least=2,
        help="tokens per packed block (encoder–decoders: encoder input tokens; a pairs source is cut there); at "
        "most the model's positions",
    )
    batch_size: int = option(at_least=1, help="blocks per micro-batch on each process")
    grad_accum: int = option(1, at_least=1, help="micro-batches per optimizer step")


@dataclass(kw_only=True)
class Optimization(Schema):
    """AdamW and its schedule."""

    lr: float = option(above=0, help="peak learning rate (AdamW)")
    warmup_steps: int = option(0, at_least=0, help="linear warmup steps, then cosine decay to min_lr_ratio × lr")
    min_lr_ratio: float = option(
        0.1, at_least=0, at_most=1, help="learning rate at the end of the cosine, relative to lr"
    )
    weight_decay: float = option(0.1, at_least=0, help="AdamW weight decay (not applied to biases and norms)")
    adam_beta1: float = option(0.9, at_least=0, below=1, help="AdamW β1")
    adam_beta2: float = option(0.95, at_least=0, below=1, help="AdamW β2")
    adam_eps: float = option(1e-8, above=0, help="AdamW ε")
    max_grad_norm: float | None = option(
        1.0, above=0, help="clip the gradient's global norm to this (null: no clipping)"
    )


@dataclass(kw_only=True)
class Distillation(Schema):
    """Distillation from the original MHA model."""

    teacher: str | None = option(None, help="frozen teacher checkpoint (same tokenizer) for distillation")
    distill_weight: float = option(0.5, at_least=0, at_most=1, help="w in loss = (1 − w)·CE + w·KL(teacher ‖ student)")
    distill_temperature: float = option(1.0, above=0, help="softmax temperature T of the KL term (scaled by T²)")


def _fused_setting(value: Any) -> Any:
    # One message for the union (its members would each be named).
    if isinstance(value, bool) or value == "auto":
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(f"must be auto, true or false, not {value!r}")


def _yaml_no(value: Any) -> Any:
    # YAML 1.1 reads a bare `no` as false.
    return "no" if value is False else value


@dataclass(kw_only=True)
class Execution(Schema):
    """How the steps run: precision, memory, kernels. Apart from `mixed_precision` and
    `document_mask`, the same computation up to float rounding."""

    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = option(
        "auto",
        before=_yaml_no,
        help="autocast; auto: `accelerate launch --mixed_precision` if given, else bf16 on GPUs that support it "
        "and no on CPU",
    )
    gradient_checkpointing: bool = option(False, help="recompute activations in the backward pass to save memory")
    compile: bool = option(
        False,
        help="torch.compile each repeated block of the model (its layers) in place, after accelerate's prepare: "
        "the same computation up to float rounding, state-dict names unchanged, so a resume may turn it on or off",
    )
    compile_backend: str = option(
        "inductor", help="torch.compile backend with `compile` (one of torch.compiler.list_backends())"
    )
    fused_adamw: Literal["auto"] | bool = option(
        "auto",
        before=_fused_setting,
        help="torch's fused AdamW kernel; auto: fused on CUDA, torch's default elsewhere (so CPU runs stay "
        "bit-identical to earlier versions); the same update up to float rounding",
    )
    document_mask: bool = option(
        False,
        help="packed documents do not see each other: positions restart after each EOS and attention stays inside "
        "each document (a block-diagonal mask; varlen kernels from positions with flash attention)",
    )
    peak_flops: float | None = option(
        None,
        above=0,
        help="peak FLOP/s of one device for perf/mfu (default: known bf16 peaks of common GPUs; none on CPU)",
    )


def _reporters(value: Any) -> Any:
    # `--report_to wandb,jsonl` and YAML `report_to: wandb` both mean a list.
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        value = [part.strip() for v in value for part in v.split(",") if part.strip()]
    return value


@dataclass(kw_only=True)
class Reporting(Schema):
    """Where metrics go besides metrics.jsonl."""

    report_to: list[Reporter] = option(
        ["wandb", "jsonl"],
        before=_reporters,
        help="wandb, jsonl, none (several allowed); metrics.jsonl is written in any case",
    )
    wandb_project: str = option("uptrain", help="wandb project name")

    def problems(self) -> list[str]:
        found = super().problems()
        if "none" in self.report_to and len(self.report_to) > 1:
            found.append("`report_to: none` cannot be combined with other reporters")
        return found


@dataclass(kw_only=True)
class Timeouts(Schema):
    """How long processes wait for each other."""

    collective_timeout_s: float | None = option(
        None,
        above=0,
        help="seconds a collective (gradient all-reduce, barrier) may wait for the other processes before the run "
        "fails (default: torch's, 600 under NCCL, 1800 under gloo)",
    )
    conversion_timeout_s: float = option(
        6 * 3600.0,
        above=0,
        help="seconds the other processes wait for the main process to convert `source` (calibration, merges, "
        "writing), whatever collective_timeout_s is",
    )


@dataclass(kw_only=True)
class RunTarget(Schema):
    """What one run trains: a checkpoint as it is, or an MHA checkpoint converted first."""

    model: str | None = option(
        None,
        help="checkpoint folder to uptrain (e.g. the output of `uptrain convert`); give either `model` or `source`",
    )
    source: str | None = option(
        None,
        help="MHA checkpoint to convert first (same code as `uptrain convert`); the result is written to "
        "OUTPUT_DIR/converted and trained",
    )
    num_kv_heads: int | None = kv_heads_option(
        None, "KV heads after conversion, every layer alike; `source` needs it, kv_heads_per_layer or kv_budget"
    )
    kv_heads_per_layer: str | None = kv_heads_per_layer_option("KV heads after conversion of `source`, layer by layer")
    kv_budget: float | None = kv_budget_option()
    allocation: Allocation = allocation_option()
    allocation_cost: AllocationCost | None = allocation_cost_option()
    cross_kv_weight: float | None = cross_kv_weight_option()
    # `uptrain convert --target mla`'s keys, as it takes them (`mla_init: calibrated` reads train_data).
    target: Target = option(
        "gqa",
        help="what `source` becomes: gqa (fewer KV heads: num_kv_heads, kv_heads_per_layer or kv_budget) or mla "
        "(multi-head latent attention in the DeepSeek-V2 layout, Llama family: kv_rank or kv_budget, rope_dims)",
    )
    # Convert's own keys (help, bounds, metavar), as `uptrain convert --target mla` takes them.
    kv_rank: int | None = option_like(ConversionSpec, "kv_rank", None)
    rope_dims: int | None = option_like(ConversionSpec, "rope_dims", None)
    rope_stride: int = option_like(ConversionSpec, "rope_stride", 1)
    rope_residual: int = option_like(ConversionSpec, "rope_residual", 0)
    rotary_key: RotaryKey = option_like(ConversionSpec, "rotary_key", "principal")
    mla_init: MLAInit = option(
        "svd", help="target mla: the latent's initialisation, svd or calibrated (calibrated on train_data)"
    )

    # The keys that choose the converted KV heads, each applied to `source` only.
    KV_HEADS_KEYS = ("num_kv_heads", "kv_heads_per_layer", "kv_budget")
    # The keys that say how a budget is spent, at their defaults (each applies to `source` only).
    BUDGET_KEYS = {"allocation": "uniform", "allocation_cost": None, "cross_kv_weight": None}
    # The keys of a latent-attention conversion of `source`, at their defaults for GQA.
    MLA_KEYS = {
        **{"target": "gqa", "kv_rank": None, "rope_dims": None, "rope_stride": 1, "rope_residual": 0},
        **{"rotary_key": "principal", "mla_init": "svd"},
    }

    def problems(self) -> list[str]:
        found = super().problems()
        given = [key for key in self.KV_HEADS_KEYS if getattr(self, key) is not None]
        latent = [key for key, default in self.MLA_KEYS.items() if getattr(self, key) != default]
        spending = [key for key, default in self.BUDGET_KEYS.items() if getattr(self, key) != default]
        if (self.model is None) == (self.source is None):
            found.append(
                "give exactly one of `model` (a checkpoint to train) or `source` (an MHA checkpoint to convert first)"
            )
        elif self.source is None and (spent := given + latent + spending):
            key = spent[0]
            found.append(f"`{key}` only applies with `source`; `model` is trained as it is")
        elif self.target == "mla":
            pass  # checked with the conversion's own rules (`mla_problems`) when it is specified
        elif self.source is not None and not given:
            found.append("`source` needs `num_kv_heads` (or `kv_heads_per_layer`, or `kv_budget`)")
        elif self.source is not None and (
            problem := kv_heads_problem(self.num_kv_heads, self.kv_heads_per_layer, self.kv_budget, self.allocation)
        ):
            found.append(problem)
        elif self.source is not None and (problem := allocation_cost_problem(self.allocation, self.allocation_cost)):
            found.append(problem)
        elif self.source is not None and (problem := cross_kv_weight_problem(self.kv_budget, self.cross_kv_weight)):
            found.append(problem)
        return found


# A dataclass lists its bases' keys last base first: the keys follow in run_config.yaml and
# `--help` as RunTarget, ConversionOptions, TrainData, …, Timeouts, then TrainConfig's own.
@dataclass(kw_only=True)
class TrainConfig(
    Timeouts,
    Reporting,
    Execution,
    Distillation,
    UptrainingBudget,
    Optimization,
    StepShape,
    TrainData,
    ConversionOptions,
    RunTarget,
):
    """Everything one uptraining run needs: what it trains, the conversion keys (applied when
    `source` is converted on the fly; calibration reads `train_data`), the data, the step, the
    optimizer, the budget, distillation, execution, reporting and timeouts, then where the run
    goes, how often it is evaluated and saved, and what to do with an earlier run.

    Budget: exactly one of max_steps, max_tokens, uptrain_fraction × pretrain_tokens (the rule
    `uptrain compare` checks too, `budgets.budget_problems`).
    """

    WHAT = "config"

    output_dir: str = option(help="run folder: metrics.jsonl, checkpoints/, final/, wandb/")
    # Cadence.
    eval_every: int = option(100, at_least=1, help="evaluate every N optimizer steps (and at step 0 and the end)")
    save_every: int = option(500, at_least=1, help="checkpoint (accelerator.save_state) every N optimizer steps")
    keep_checkpoints: int = option(2, at_least=1, help="keep the last K checkpoints")
    log_every: int = option(1, at_least=1, help="log training metrics every N optimizer steps")
    seed: int = seed_option("seed for data order and initialisation")
    run_name: str | None = option(None, help="run name in wandb (default: the output_dir's name)")
    wandb_group: str | None = option(None, help="wandb group that collects related runs (e.g. a comparison)")
    # What to do with an existing output_dir.
    resume: bool = option(False, help="continue the run in output_dir from its latest checkpoint")
    overwrite: bool = option(False, help="delete an existing output_dir and start over")

    def problems(self) -> list[str]:
        found = super().problems()
        if self.resume and self.overwrite:
            found.append("`resume` and `overwrite` exclude each other")
        if self.source is not None and self.target == "gqa":
            found += merge_key_problems(self)
        return found

    def conversion_spec(self) -> ConversionSpec:
        """The conversion of `source` this run starts with (calibrated on `train_data`)."""
        kv_heads = {key: getattr(self, key) for key in (*self.KV_HEADS_KEYS, *self.BUDGET_KEYS)}
        latent = {key: getattr(self, key) for key in self.MLA_KEYS}
        if self.target == "mla" and self.mla_init != "calibrated":  # reads no calibration data
            latent["calibration_data"] = None
        return training_conversion(self, source=self.source, **kv_heads, **latent)

    @property
    def trackers(self) -> list[str]:
        """Accelerate trackers to start (metrics.jsonl is written separately, always)."""
        return [r for r in self.report_to if r == "wandb"]

    def tokens_per_step(self, num_processes: int) -> int:
        """Tokens consumed by one optimizer step across all processes: seq_len per example, for
        encoder–decoders too (their encoder positions, padding included, as T5 counts its
        pretraining tokens: 2^19 steps × 128 × 512 = 2^35); budgets and tokens/s read this."""
        return self.seq_len * self.batch_size * self.grad_accum * num_processes

    def total_steps(self, num_processes: int) -> int:
        """Optimizer steps of the whole run, from whichever budget was given."""
        if self.max_steps is not None:
            return self.max_steps
        tokens = self.max_tokens if self.max_tokens is not None else self.uptrain_fraction * self.pretrain_tokens
        return max(1, math.ceil(tokens / self.tokens_per_step(num_processes)))


# The conversion's keys → the training keys each takes its value from: calibration reads the
# text the run trains on, as the run reads it, in blocks of its length, with Whisper's targets
# framed as it frames them. `uptrain train` and `uptrain compare` both convert through it.
CALIBRATED_AS_TRAINED = {
    "seed": "seed",
    "calibration_data": "train_data",
    "calibration_dataset_config": "dataset_config",
    "calibration_split": "train_split",
    "calibration_seq_len": "seq_len",
    "text_field": "text_field",
    "sample_by": "sample_by",
    "language": "language",
    "speech_task": "speech_task",
    "source_lang": "source_lang",
    "target_lang": "target_lang",
    "calibration_objective": "objective",
}


def training_conversion(run, *, source: str, num_kv_heads: int | None, **chosen) -> ConversionSpec:
    """The conversion a run with `run`'s keys (`TrainData`, `StepShape`, `ConversionOptions` and a
    seed: a `TrainConfig` or a `CompareSpec`) starts with: its conversion keys, calibrated on its
    training text (`CALIBRATED_AS_TRAINED`); `chosen` overrides any key (compare's pooling per run)."""
    values = {name: getattr(run, name) for name in names_of(ConversionOptions)}
    values.update({key: getattr(run, trained) for key, trained in CALIBRATED_AS_TRAINED.items()})
    return conversion_spec(**{**values, "source": source, "num_kv_heads": num_kv_heads, **chosen})


# Keys that change bookkeeping but not the loss curve: a resumed run may change them freely.
# (batch_size and grad_accum may change too as long as batch_size × grad_accum × processes does not.)
OPERATIONAL_KEYS = frozenset(
    {
        "resume",
        "overwrite",
        "report_to",
        "wandb_project",
        "run_name",
        "wandb_group",
        "eval_every",
        "save_every",
        "keep_checkpoints",
        "log_every",
        "peak_flops",
        "data_workers",
        "batch_size",
        "grad_accum",
        "calibration_device",
        "source_hash",
        "collective_timeout_s",
        "conversion_timeout_s",
        # How the same computation runs (kernels, compiled or not): float rounding apart, the same curve.
        "compile",
        "compile_backend",
        "fused_adamw",
    }
)


def validated_config(values: dict[str, Any], command: str = "train", path: str | Path | None = None) -> TrainConfig:
    """`TrainConfig(**values)`; bad values raise one UptrainError naming every offending key (and
    `path`, the file they came from)."""
    return validated_values(TrainConfig, values, command, path)


def load_config(path: str | Path | None, overrides: dict[str, Any]) -> TrainConfig:
    """Read a YAML file (optional), apply `overrides` on top, validate. Raises UptrainError."""
    return load(TrainConfig, path, overrides, "train")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--config` and one flag per config key (`--seq_len` and `--seq-len` both work), as
    `uptrain train` has them (for scripts with a parser of their own, `recipes/uptrain.py`)."""
    add_schema_arguments(parser, TrainConfig, config_file=True)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The validated config of a parsed `uptrain train` command line."""
    return from_args(TrainConfig, args, "train", config=getattr(args, "config", None))


def config_to_yaml(config: TrainConfig) -> str:
    """The config as YAML, keys in schema order (written to OUTPUT_DIR/run_config.yaml)."""
    import yaml

    return yaml.safe_dump(config.to_dict(), sort_keys=False)
