"""The `uptrain train` configuration: one validated schema, read from YAML and overridden by flags.

Every field is a config key and a `--flag` of the same name; its description is the `--help` text.
Unknown keys are refused (`extra="forbid"`) so that a typo never silently falls back to a default.
The conversion keys and the budget keys are not declared here: they are the keys of
`ConversionOptions` and `UptrainingBudget` (stdlib schemas, see `uptrain.options`), embedded
as pydantic fields with the same types, defaults, help and checks.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from uptrain import UptrainError
from uptrain.budgets import UptrainingBudget, budget_problems
from uptrain.convert.spec import SEED_RANGE, ConversionOptions, ConversionSpec
from uptrain.options import REQUIRED, Key, Option, add_arguments, given, key_problem, keys_of
from uptrain.strict_json import too_many_digits

Reporter = Literal["wandb", "jsonl", "none"]
Objective = Literal["causal", "span_corruption", "text_infilling", "pairs", "speech_pairs"]
EMBEDDED = (ConversionOptions, UptrainingBudget)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _embedded(schema: type, base: type[BaseModel]) -> type[BaseModel]:
    """`base` extended by the keys of a dataclass schema, as pydantic fields: the same names,
    types, defaults and help, each value checked by the schema's own check."""
    keys = {k.name: k for k in keys_of(schema)}

    def check(cls, value: Any, info) -> Any:
        problem, value = key_problem(keys[info.field_name], value)
        if problem:
            raise ValueError(problem)
        return value

    fields: dict[str, Any] = {
        k.name: (k.annotation, Field(k.default, description=k.option.help)) for k in keys.values()
    }
    return create_model(
        f"_{schema.__name__}Keys",
        __base__=base,
        # named per schema: a subclass's validator of the same name would replace its base's
        __validators__={f"_check_{schema.__name__}": field_validator(*keys)(check)},
        **fields,
    )


class _RunKeys(_embedded(ConversionOptions, _Strict)):
    """The conversion keys (applied when `source` is converted on the fly; calibration reads
    `train_data`), then what to train, on what data, and how. The budget keys follow (see
    TrainConfig): the class is split only so that every key keeps its place in run_config.yaml
    and `--help`."""

    # What to train.
    model: str | None = Field(
        None,
        description="checkpoint folder to uptrain (e.g. the output of `uptrain convert`); "
        "give either `model` or `source`",
    )
    source: str | None = Field(
        None,
        description="MHA checkpoint to convert first (same code as `uptrain convert`); "
        "the result is written to OUTPUT_DIR/converted and trained",
    )
    num_kv_heads: int | None = Field(None, ge=1, description="KV heads after conversion; required with `source`")
    # Data.
    train_data: str | list[str] = Field(
        ...,
        description="training text: local .txt/.jsonl/.json/.parquet file(s) "
        "or folder, or a datasets Hub name (streamed)",
    )
    eval_data: str | list[str] = Field(
        ..., description="evaluation text, same forms as `train_data`; the same blocks are scored at every evaluation"
    )
    dataset_config: str | None = Field(None, description="configuration name of a Hub `train_data` (e.g. sample-10BT)")
    eval_dataset_config: str | None = Field(
        None, description="configuration name of a Hub `eval_data` (default: dataset_config)"
    )
    train_split: str = Field("train", description="split of a Hub `train_data`")
    eval_split: str = Field("validation", description="split of a Hub `eval_data` (local files have only `train`)")
    text_field: str = Field("text", description="column holding the text in jsonl/parquet/Hub datasets")
    sample_by: Literal["line", "paragraph", "document"] = Field(
        "paragraph", description="what one document is in a .txt file; documents are joined with EOS"
    )
    streaming: bool | None = Field(
        None,
        description="stream the data instead of tokenizing it all up front "
        "(default: true for Hub names, false for local files)",
    )
    objective: Objective | None = Field(
        None,
        description="what the model learns: causal (next token), span_corruption (T5), text_infilling (BART), "
        "pairs (jsonl `source`/`target`), speech_pairs (jsonl `audio`/`text`); default: causal for models "
        "without an encoder, else the family's (t5 span_corruption, bart/mbart text_infilling, marian pairs, "
        "whisper speech_pairs)",
    )
    target_len: int | None = Field(
        None, ge=1, description="most target tokens of a pairs/speech_pairs example (longer are cut); default: seq_len"
    )
    eval_blocks: int = Field(
        64, ge=1, description="most `seq_len` blocks (pairs: examples) of `eval_data` used for evaluation"
    )
    data_workers: int | None = Field(
        None,
        ge=1,
        description="processes that tokenize: for data tokenized up front in all; for streamed data, "
        "DataLoader workers per process, each reading its own share (default: 1)",
    )

    # Shape of a step.
    output_dir: str = Field(..., description="run folder: metrics.jsonl, checkpoints/, final/, wandb/")
    seq_len: int = Field(
        ...,
        ge=2,
        description="tokens per packed block (encoder–decoders: encoder input tokens; a pairs source is cut "
        "there); at most the model's positions",
    )
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
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="clip the gradient's global norm to this (null: no clipping)"
    )

    @field_validator("train_data", "eval_data")
    @classmethod
    def _non_empty(cls, value: str | list[str]) -> str | list[str]:
        if not value or (isinstance(value, list) and not all(value)):
            raise ValueError("must name at least one file or dataset")
        return value


class TrainConfig(_embedded(UptrainingBudget, _RunKeys)):
    """Everything one uptraining run needs. Field descriptions double as `--help` text.

    Budget: exactly one of max_steps, max_tokens, uptrain_fraction × pretrain_tokens (the rule
    `uptrain compare` checks too, `budgets.budget_problems`).
    """

    # Distillation from the original MHA model.
    teacher: str | None = Field(None, description="frozen teacher checkpoint (same tokenizer) for distillation")
    distill_weight: float = Field(0.5, ge=0, le=1, description="w in loss = (1 − w)·CE + w·KL(teacher ‖ student)")
    distill_temperature: float = Field(1.0, gt=0, description="softmax temperature T of the KL term (scaled by T²)")

    # Cadence, precision, reporting.
    eval_every: int = Field(100, ge=1, description="evaluate every N optimizer steps (and at step 0 and the end)")
    save_every: int = Field(500, ge=1, description="checkpoint (accelerator.save_state) every N optimizer steps")
    keep_checkpoints: int = Field(2, ge=1, description="keep the last K checkpoints")
    log_every: int = Field(1, ge=1, description="log training metrics every N optimizer steps")
    seed: int = Field(0, ge=SEED_RANGE[0], le=SEED_RANGE[1], description="seed for data order and initialisation")
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field(
        "auto",
        description="autocast; auto: `accelerate launch --mixed_precision` if given, else bf16 on GPUs "
        "that support it and no on CPU",
    )
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass to save memory")
    compile: bool = Field(
        False,
        description="torch.compile each repeated block of the model (its layers) in place, after accelerate's "
        "prepare: the same computation up to float rounding, state-dict names unchanged, so a resume may turn "
        "it on or off",
    )
    compile_backend: str = Field(
        "inductor", description="torch.compile backend with `compile` (one of torch.compiler.list_backends())"
    )
    fused_adamw: Literal["auto"] | bool = Field(
        "auto",
        description="torch's fused AdamW kernel; auto: fused on CUDA, torch's default elsewhere (so CPU runs "
        "stay bit-identical to earlier versions); the same update up to float rounding",
    )
    document_mask: bool = Field(
        False,
        description="packed documents do not see each other: positions restart after each EOS and attention "
        "stays inside each document (a block-diagonal mask; varlen kernels from positions with flash attention)",
    )
    peak_flops: float | None = Field(
        None,
        gt=0,
        description="peak FLOP/s of one device for perf/mfu (default: known bf16 peaks of common GPUs; none on CPU)",
    )
    report_to: list[Reporter] = Field(
        ["wandb", "jsonl"], description="wandb, jsonl, none (several allowed); metrics.jsonl is written in any case"
    )
    wandb_project: str = Field("uptrain", description="wandb project name")
    run_name: str | None = Field(None, description="run name in wandb (default: the output_dir's name)")
    wandb_group: str | None = Field(None, description="wandb group that collects related runs (e.g. a comparison)")

    # How long processes wait for each other.
    collective_timeout_s: float | None = Field(
        None,
        gt=0,
        description="seconds a collective (gradient all-reduce, barrier) may wait for the other processes before "
        "the run fails (default: torch's, 600 under NCCL, 1800 under gloo)",
    )
    conversion_timeout_s: float = Field(
        6 * 3600,
        gt=0,
        description="seconds the other processes wait for the main process to convert `source` (calibration, "
        "merges, writing), whatever collective_timeout_s is",
    )

    # What to do with an existing output_dir.
    resume: bool = Field(False, description="continue the run in output_dir from its latest checkpoint")
    overwrite: bool = Field(False, description="delete an existing output_dir and start over")

    @field_validator("report_to", mode="before")
    @classmethod
    def _split_reporters(cls, value: Any) -> Any:
        # `--report_to wandb,jsonl` and YAML `report_to: wandb` both mean a list.
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        return value

    @field_validator("fused_adamw", mode="before")
    @classmethod
    def _fused_setting(cls, value: Any) -> Any:
        # One message for the union (pydantic would report each of its members).
        if isinstance(value, bool) or value == "auto":
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ValueError(f"must be auto, true or false, not {value!r}")

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `no` as false.
        return "no" if value is False else value

    @model_validator(mode="after")
    def _check_combinations(self) -> TrainConfig:
        if (self.model is None) == (self.source is None):
            raise ValueError(
                "give exactly one of `model` (a checkpoint to train) or `source` (an MHA checkpoint to convert first)"
            )
        if self.source is not None and self.num_kv_heads is None:
            raise ValueError("`source` needs `num_kv_heads`")
        if self.source is None and self.num_kv_heads is not None:
            raise ValueError("`num_kv_heads` only applies with `source`; `model` is trained as it is")
        if problems := budget_problems(self):
            raise ValueError(problems[0])
        if "none" in self.report_to and len(self.report_to) > 1:
            raise ValueError("`report_to: none` cannot be combined with other reporters")
        if self.target_len is not None and self.objective not in (None, "pairs", "speech_pairs"):
            raise ValueError(f"`target_len` applies to objective pairs and speech_pairs, not {self.objective}")
        if self.resume and self.overwrite:
            raise ValueError("`resume` and `overwrite` exclude each other")
        return self

    def conversion_spec(self) -> ConversionSpec:
        """The conversion of `source` this run starts with (calibrated on `train_data`)."""
        shared = {k.name: getattr(self, k.name) for k in keys_of(ConversionOptions)}
        return ConversionSpec(
            source=self.source,
            num_kv_heads=self.num_kv_heads,
            seed=self.seed,
            calibration_data=self.train_data,
            calibration_dataset_config=self.dataset_config,
            calibration_split=self.train_split,
            calibration_seq_len=self.seq_len,
            text_field=self.text_field,
            sample_by=self.sample_by,
            **shared,
        )

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


def format_validation_error(err: ValidationError, path: str | Path | None, command: str = "train") -> str:
    """One line naming every offending key."""
    problems = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            problems.append(f"unknown key `{key}` (see `uptrain {command} --help`)")
        elif e["type"] == "missing":
            problems.append(f"`{key}` is required")
        else:
            message = e["msg"].removeprefix("Value error, ")
            problems.append(f"`{key}`: {message}" if key else message)
    where = f"{path}: " if path else ""
    what = "config" if command == "train" else "option"  # train reads YAML keys; the others flags
    return f"{where}invalid {what}: " + "; ".join(problems)


def validated_config(values: dict[str, Any], command: str = "train", path: str | Path | None = None) -> TrainConfig:
    """`TrainConfig(**values)`; bad values raise one UptrainError naming every offending key (and
    `path`, the file they came from)."""
    try:
        return TrainConfig(**values)
    except ValidationError as err:
        raise UptrainError(format_validation_error(err, path, command)) from None


# What PyYAML's constructors raise, beside YAMLError, on values its own resolver let through.
YAML_CONSTRUCTION_ERRORS = (ValueError, TypeError, AttributeError, LookupError, ArithmeticError)
MAX_CONFIG_BYTES = 1 << 20  # a config is a page of keys; anything larger is not one, and parsing it costs


def read_yaml(path: Path) -> Any:
    """The YAML document in `path`; anything that is not a config file is one UptrainError."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)  # read no more than the bound, whatever the file holds
    except OSError as err:
        raise UptrainError(f"cannot read {path}: {err.strerror or err}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise UptrainError(f"{path} is larger than a config can be ({MAX_CONFIG_BYTES // 2**20} MiB)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UptrainError(f"{path} is not UTF-8 text (byte {err.start})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise UptrainError(f"{path} is not valid YAML: {str(err).splitlines()[0]}") from None
    except YAML_CONSTRUCTION_ERRORS as err:  # past Python's 4300 digits; 2024-13-01; `!!int` on nothing
        if too_many_digits(err):
            raise UptrainError(f"{path}: {too_many_digits(err)}") from None
        raise UptrainError(f"{path} is not valid YAML: {str(err).splitlines()[0]}") from None
    except RecursionError:
        raise UptrainError(f"{path} is not valid YAML (nested too deeply)") from None


def load_config(path: str | Path | None, overrides: dict[str, Any]) -> TrainConfig:
    """Read a YAML file (optional), apply `overrides` on top, validate. Raises UptrainError."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UptrainError(f"config file {path} does not exist")
        loaded = read_yaml(path)
        if loaded is not None and not isinstance(loaded, dict):
            raise UptrainError(f"{path} must hold a mapping of config keys, not {type(loaded).__name__}")
        if bad := [k for k in loaded or {} if not isinstance(k, str)]:  # `1: x`, `? [a]: x`, a bare `?`
            raise UptrainError(f"{path}: config keys are names, not {bad[0]!r}")
        values.update(loaded or {})
    values.update(overrides)
    return validated_config(values, path=path)


def config_keys() -> list[Key]:
    """TrainConfig's keys as `uptrain.options` sees them: an embedded schema's keys as that
    schema declares them (help, choices, group), the others from their pydantic fields."""
    embedded = {k.name: k for schema in EMBEDDED for k in keys_of(schema)}
    return [
        embedded.get(name)
        or Key(
            name,
            field.annotation,
            REQUIRED if field.is_required() else field.default,
            Option(help=field.description or ""),
        )
        for name, field in TrainConfig.model_fields.items()
    ]


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--config` and one flag per config key (`--seq_len` and `--seq-len` both work)."""
    parser.add_argument("--config", metavar="FILE.yaml", help="YAML file of config keys; flags override it")
    add_arguments(
        parser, config_keys(), file_keys=True, group="config keys (each also a YAML key; flags override the file)"
    )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The validated config of a parsed `uptrain train` command line."""
    return load_config(getattr(args, "config", None), given(args, config_keys()))


def config_to_yaml(config: TrainConfig) -> str:
    """The config as YAML, keys in schema order (written to OUTPUT_DIR/run_config.yaml)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
