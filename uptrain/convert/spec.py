"""What a conversion is, validated once: the schema that `uptrain convert`, `uptrain train`
(converting `source` on the fly) and `uptrain compare` all build on."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from uptrain import UptrainError

Grouping = Literal["contiguous", "similarity"]
DType = Literal["float32", "float16", "bfloat16"]
SourceHash = Literal["blake3", "sha256", "none"]


def parse_size(size: int | str) -> int:
    """'5GB' → 5·10⁹, '500MiB' → 500·2²⁰, 1000 → 1000 (bytes); at least one byte."""
    if isinstance(size, bool):
        raise UptrainError(f"cannot read size {size!r}; use e.g. 5GB, 500MB or 2GiB")
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", size, re.IGNORECASE)
        if not m:
            raise UptrainError(f"cannot read size {size!r}; use e.g. 5GB, 500MB or 2GiB")
        base = 1024 if m.group(3) else 1000
        value = int(float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " "))
    if value < 1:
        raise UptrainError(f"size {size!r} is less than one byte")
    return value


class ConversionOptions(BaseModel):
    """How K/V heads are pooled: the keys every entry point shares (each also a `uptrain train` key)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    pooling: str = Field("mean", description="pooling strategy (mean, first, random, calibrated: calibrated on "
                                             "`calibration_tokens` of the calibration text)")
    grouping: Grouping = Field("contiguous", description="which heads share a KV head: contiguous (query head i → "
                                                         "KV head i // (h/G)) or similarity (heads renumbered "
                                                         "exactly so that similar K/V heads are grouped)")
    calibration_tokens: int = Field(32768, ge=1, description="tokens of calibration text read through the source "
                                                             "model (`calibrated` pooling, `similarity` grouping)")
    calibration_device: str = Field("auto", description="where calibration runs the source model: auto (the first "
                                                        "GPU when there is one), cpu, cuda or cuda:N")
    calibration_dtype: DType = Field("float32", description="dtype of calibration's forward pass (moments are "
                                                            "accumulated in float64); bfloat16 for GPUs")
    source_hash: SourceHash = Field("blake3", description="digest of each source file recorded in uptrain.json")

    @field_validator("pooling")
    @classmethod
    def _registered(cls, value: str) -> str:
        from uptrain.convert.pooling import STRATEGIES

        if value not in STRATEGIES:
            raise ValueError(f"unknown pooling {value!r}; choose from {', '.join(sorted(STRATEGIES))}")
        return value

    @field_validator("calibration_device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
            raise ValueError(f"{value!r} is not auto, cpu, cuda or cuda:N")
        return value


class ConversionSpec(ConversionOptions):
    """One conversion: a source checkpoint, the KV heads it becomes, and how."""

    source: str = Field(..., description="checkpoint folder or Hub id")
    num_kv_heads: int = Field(..., description="KV heads after conversion")
    seed: int = Field(0, description="seed of `random` pooling")
    dtype: DType | None = Field(None, description="cast floating-point tensors (default: keep each tensor's dtype)")
    calibration_data: str | list[str] | None = Field(None, description="calibration text (files or a datasets name)")
    calibration_dataset_config: str | None = Field(None, description="configuration of a Hub calibration dataset")
    calibration_split: str = Field("train", description="split of a Hub calibration dataset (streamed)")
    calibration_seq_len: int = Field(256, ge=2, description="tokens per calibration block")
    text_field: str = Field("text", description="column holding the text in jsonl/parquet/Hub data")
    sample_by: Literal["line", "paragraph", "document"] = Field("paragraph", description="one document in .txt")
    max_shard_size: int | str = Field("5GB", description="largest output shard")
    allow_pickle: bool = Field(False, description="read pytorch_model*.bin with torch.load(weights_only=True)")

    @field_validator("max_shard_size")
    @classmethod
    def _size(cls, value: int | str) -> int | str:
        try:
            parse_size(value)
        except UptrainError as err:
            raise ValueError(str(err)) from None
        return value


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


def validated(schema: type[BaseModel], command: str = "convert", **values) -> BaseModel:
    """`schema(**values)`; bad values raise one UptrainError naming every offending key."""
    try:
        return schema(**values)
    except ValidationError as err:
        raise UptrainError(format_validation_error(err, None, command)) from None


def conversion_spec(**values) -> ConversionSpec:
    """A validated ConversionSpec (see `validated`)."""
    return validated(ConversionSpec, **values)
