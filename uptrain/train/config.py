"""The `uptrain train` configuration: one validated schema, read from YAML and overridden by flags.

Every field is a config key and a `--flag` of the same name; its description is the `--help` text.
Unknown keys are refused (`extra="forbid"`) so that a typo never silently falls back to a default.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from uptrain import UptrainError
from uptrain.convert.spec import ConversionOptions, ConversionSpec, format_validation_error

Reporter = Literal["wandb", "jsonl", "none"]


class TrainConfig(ConversionOptions):
    """Everything one uptraining run needs. Field descriptions double as `--help` text.

    The conversion keys (pooling, grouping, calibration_*, source_hash) come from
    `ConversionOptions` and apply when `source` is converted on the fly; calibration reads
    `train_data`.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # What to train.
    model: str | None = Field(None, description="checkpoint folder to uptrain (e.g. the output of `uptrain convert`); "
                                                "give either `model` or `source`")
    source: str | None = Field(None, description="MHA checkpoint to convert first (same code as `uptrain convert`); "
                                                 "the result is written to OUTPUT_DIR/converted and trained")
    num_kv_heads: int | None = Field(None, ge=1, description="KV heads after conversion; required with `source`")
    # Data.
    train_data: str | list[str] = Field(..., description="training text: local .txt/.jsonl/.json/.parquet file(s) "
                                                        "or folder, or a datasets Hub name (streamed)")
    eval_data: str | list[str] = Field(..., description="evaluation text, same forms as `train_data`; the same "
                                                       "blocks are scored at every evaluation")
    dataset_config: str | None = Field(None, description="configuration name of a Hub `train_data` (e.g. sample-10BT)")
    eval_dataset_config: str | None = Field(None, description="configuration name of a Hub `eval_data` (default: "
                                                              "dataset_config)")
    train_split: str = Field("train", description="split of a Hub `train_data`")
    eval_split: str = Field("validation", description="split of a Hub `eval_data` (local files have only `train`)")
    text_field: str = Field("text", description="column holding the text in jsonl/parquet/Hub datasets")
    sample_by: Literal["line", "paragraph", "document"] = Field(
        "paragraph", description="what one document is in a .txt file; documents are joined with EOS")
    streaming: bool | None = Field(None, description="stream the data instead of tokenizing it all up front "
                                                     "(default: true for Hub names, false for local files)")
    eval_blocks: int = Field(64, ge=1, description="most `seq_len` blocks of `eval_data` used for evaluation")
    data_workers: int | None = Field(None, ge=1, description="processes that tokenize local data (default: 1)")

    # Shape of a step.
    output_dir: str = Field(..., description="run folder: metrics.jsonl, checkpoints/, final/, wandb/")
    seq_len: int = Field(..., ge=2, description="tokens per packed block; at most the model's positions")
    batch_size: int = Field(..., ge=1, description="blocks per micro-batch on each process")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")

    # Optimizer and schedule.
    lr: float = Field(..., gt=0, description="peak learning rate (AdamW)")
    warmup_steps: int = Field(0, ge=0, description="linear warmup steps, then cosine decay to min_lr_ratio × lr")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="learning rate at the end of the cosine, relative to lr")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay (not applied to biases and norms)")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW β1")
    adam_beta2: float = Field(0.95, ge=0, lt=1, description="AdamW β2")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW ε")
    max_grad_norm: float | None = Field(1.0, gt=0, description="clip the gradient's global norm to this "
                                                               "(null: no clipping)")

    # Budget: exactly one of max_steps, max_tokens, uptrain_fraction × pretrain_tokens.
    max_steps: int | None = Field(None, ge=1, description="optimizer steps to train")
    max_tokens: int | None = Field(None, ge=1, description="tokens to train on (rounded up to whole steps)")
    uptrain_fraction: float | None = Field(None, gt=0, le=1, description="α: share of the original pretraining "
                                                                         "tokens to uptrain for (paper: 0.05)")
    pretrain_tokens: float | None = Field(None, gt=0, description="tokens the source model was pretrained on "
                                                                 "(e.g. 2e12 for Llama-2); with uptrain_fraction; "
                                                                 "default: the published budget of a known family "
                                                                 "(Pythia, OPT, GPT-J, BLOOM, Llama-1/2)")

    # Distillation from the original MHA model.
    teacher: str | None = Field(None, description="frozen teacher checkpoint (same tokenizer) for distillation")
    distill_weight: float = Field(0.5, ge=0, le=1, description="w in loss = (1 − w)·CE + w·KL(teacher ‖ student)")
    distill_temperature: float = Field(1.0, gt=0, description="softmax temperature T of the KL term (scaled by T²)")

    # Cadence, precision, reporting.
    eval_every: int = Field(100, ge=1, description="evaluate every N optimizer steps (and at step 0 and the end)")
    save_every: int = Field(500, ge=1, description="checkpoint (accelerator.save_state) every N optimizer steps")
    keep_checkpoints: int = Field(2, ge=1, description="keep the last K checkpoints")
    log_every: int = Field(1, ge=1, description="log training metrics every N optimizer steps")
    seed: int = Field(0, description="seed for data order and initialisation")
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field(
        "auto", description="autocast; auto: `accelerate launch --mixed_precision` if given, else bf16 on GPUs "
                            "that support it and no on CPU")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass to save memory")
    peak_flops: float | None = Field(None, gt=0, description="peak FLOP/s of one device for perf/mfu (default: "
                                                            "known bf16 peaks of common GPUs; none on CPU)")
    report_to: list[Reporter] = Field(["wandb", "jsonl"], description="wandb, jsonl, none (several allowed); "
                                                                     "metrics.jsonl is written in any case")
    wandb_project: str = Field("uptrain", description="wandb project name")
    run_name: str | None = Field(None, description="run name in wandb (default: the output_dir's name)")
    wandb_group: str | None = Field(None, description="wandb group that collects related runs (e.g. a comparison)")

    # What to do with an existing output_dir.
    resume: bool = Field(False, description="continue the run in output_dir from its latest checkpoint")
    overwrite: bool = Field(False, description="delete an existing output_dir and start over")

    @field_validator("train_data", "eval_data")
    @classmethod
    def _non_empty(cls, value: str | list[str]) -> str | list[str]:
        if not value or (isinstance(value, list) and not all(value)):
            raise ValueError("must name at least one file or dataset")
        return value

    @field_validator("report_to", mode="before")
    @classmethod
    def _split_reporters(cls, value: Any) -> Any:
        # `--report_to wandb,jsonl` and YAML `report_to: wandb` both mean a list.
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        return value

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `no` as false.
        return "no" if value is False else value

    @model_validator(mode="after")
    def _check_combinations(self) -> TrainConfig:
        if (self.model is None) == (self.source is None):
            raise ValueError("give exactly one of `model` (a checkpoint to train) or `source` (an MHA checkpoint "
                             "to convert first)")
        if self.source is not None and self.num_kv_heads is None:
            raise ValueError("`source` needs `num_kv_heads`")
        if self.source is None and self.num_kv_heads is not None:
            raise ValueError("`num_kv_heads` only applies with `source`; `model` is trained as it is")
        budgets = [name for name, given in (("max_steps", self.max_steps is not None),
                                            ("max_tokens", self.max_tokens is not None),
                                            ("uptrain_fraction", self.uptrain_fraction is not None))
                   if given]
        if len(budgets) != 1:
            raise ValueError("give exactly one budget: `max_steps`, `max_tokens`, or `uptrain_fraction` (with "
                             f"`pretrain_tokens` unless the model's family is known) (got {', '.join(budgets) or 'none'})")
        if self.pretrain_tokens is not None and self.uptrain_fraction is None:
            raise ValueError("`pretrain_tokens` only applies with `uptrain_fraction`")
        if "none" in self.report_to and len(self.report_to) > 1:
            raise ValueError("`report_to: none` cannot be combined with other reporters")
        if self.resume and self.overwrite:
            raise ValueError("`resume` and `overwrite` exclude each other")
        return self

    def conversion_spec(self) -> ConversionSpec:
        """The conversion of `source` this run starts with (calibrated on `train_data`)."""
        shared = self.model_dump(include=set(ConversionOptions.model_fields))
        return ConversionSpec(source=self.source, num_kv_heads=self.num_kv_heads, seed=self.seed,
                              calibration_data=self.train_data, calibration_dataset_config=self.dataset_config,
                              calibration_split=self.train_split, calibration_seq_len=self.seq_len,
                              text_field=self.text_field, sample_by=self.sample_by, **shared)

    @property
    def trackers(self) -> list[str]:
        """Accelerate trackers to start (metrics.jsonl is written separately, always)."""
        return [r for r in self.report_to if r == "wandb"]

    def tokens_per_step(self, num_processes: int) -> int:
        """Tokens consumed by one optimizer step across all processes."""
        return self.seq_len * self.batch_size * self.grad_accum * num_processes

    def total_steps(self, num_processes: int) -> int:
        """Optimizer steps of the whole run, from whichever budget was given."""
        if self.max_steps is not None:
            return self.max_steps
        tokens = self.max_tokens if self.max_tokens is not None else self.uptrain_fraction * self.pretrain_tokens
        return max(1, math.ceil(tokens / self.tokens_per_step(num_processes)))


# Keys that change bookkeeping but not the loss curve: a resumed run may change them freely.
# (batch_size and grad_accum may change too as long as batch_size × grad_accum × processes does not.)
OPERATIONAL_KEYS = frozenset({"resume", "overwrite", "report_to", "wandb_project", "run_name", "wandb_group",
                              "eval_every", "save_every", "keep_checkpoints", "log_every", "peak_flops",
                              "data_workers", "batch_size", "grad_accum", "calibration_device", "source_hash"})


def load_config(path: str | Path | None, overrides: dict[str, Any]) -> TrainConfig:
    """Read a YAML file (optional), apply `overrides` on top, validate. Raises UptrainError."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UptrainError(f"config file {path} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise UptrainError(f"{path} is not valid YAML: {str(err).splitlines()[0]}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise UptrainError(f"{path} must hold a mapping of config keys, not {type(loaded).__name__}")
        values.update(loaded or {})
    values.update(overrides)
    try:
        return TrainConfig(**values)
    except ValidationError as err:
        raise UptrainError(format_validation_error(err, path)) from None


def _is_text(annotation: Any) -> bool:
    """Fields whose flag value is taken verbatim (a path named `123` or `no` stays a string)."""
    args = get_args(annotation)
    if annotation is str or get_origin(annotation) is Literal:
        return True
    return bool(args) and str in args


def _parse_flag_value(text: str) -> Any:
    # YAML scalars so `--lr 3e-4`, `--max_grad_norm null` and `--resume true` mean what they say in a file.
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--config` and one flag per config key (`--seq_len` and `--seq-len` both work)."""
    parser.add_argument("--config", metavar="FILE.yaml", help="YAML file of config keys; flags override it")
    group = parser.add_argument_group("config keys (each also a YAML key; flags override the file)")
    for name, field in TrainConfig.model_fields.items():
        flags = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        shown = " ".join(field.default) if isinstance(field.default, list) else field.default
        default = "" if field.is_required() or field.default is None else f" (default: {shown})"
        required = " [required]" if field.is_required() else ""
        kwargs: dict[str, Any] = dict(dest=name, default=argparse.SUPPRESS,
                                      help=f"{field.description}{default}{required}")
        if field.annotation is bool:
            # `--resume` alone means true; `--resume false` is accepted too.
            kwargs.update(nargs="?", const=True, type=_parse_flag_value, metavar="BOOL")
        elif name in ("report_to", "train_data", "eval_data"):
            kwargs.update(nargs="+", metavar=name.upper())
        elif _is_text(field.annotation):
            kwargs.update(metavar=name.upper())
        else:
            kwargs.update(type=_parse_flag_value, metavar=name.upper())
        group.add_argument(*flags, **kwargs)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The validated config of a parsed `uptrain train` command line."""
    overrides = {name: getattr(args, name) for name in TrainConfig.model_fields if hasattr(args, name)}
    for name in ("train_data", "eval_data"):
        if isinstance(overrides.get(name), list) and len(overrides[name]) == 1:
            overrides[name] = overrides[name][0]
    return load_config(getattr(args, "config", None), overrides)


def config_to_yaml(config: TrainConfig) -> str:
    """The config as YAML, keys in schema order (written to OUTPUT_DIR/run_config.yaml)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
