"""What a conversion is, validated once: the schemas that `uptrain convert`, `uptrain train`
(converting `source` on the fly) and `uptrain compare` all build on.

Stdlib dataclasses (`uptrain.options`), so that validating `uptrain convert`'s arguments adds
nothing to its start-up. The conversion keys are flat everywhere: `ConversionOptions` is one
group of keys that `ConversionSpec`, `TrainConfig` and `CompareSpec` all build on, so that
`--grouping similarity` is the same key, with the same check, in every command.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Literal

from uptrain import UptrainError
from uptrain.architecture import DEFAULT_ATTENTIONS, STACK_KV_HEADS
from uptrain.convert.kv_heads import (
    KVHeadsRequest,
    allocation_cost_problem,
    cross_kv_weight_problem,
    kv_heads_problem,
    parse_kv_heads_per_layer,
)
from uptrain.options import Schema, option, validated

Grouping = Literal["contiguous", "similarity"]
DType = Literal["float32", "float16", "bfloat16"]
SourceHash = Literal["blake3", "sha256", "none"]
CalibrationWeighting = Literal["uniform", "attention"]
ValueFit = Literal["inputs", "output"]
DEFAULT_VALUE_FIT_BLEND = 0.1  # λ of `--value-fit output` (`value_refit.py`)
Target = Literal["gqa", "mla"]
RotaryKey = Literal["principal", "mean", "calibrated"]
MLAInit = Literal["svd", "calibrated"]


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


def strategies() -> dict[str, str]:
    """The registered pooling strategies and where each comes from (imports torch: asked only
    when a value is checked or `--help` is built)."""
    from uptrain.convert.pooling import STRATEGIES

    return {s.name: s.reference for s in STRATEGIES.values()}


def _size_problem(value: int | str) -> str | None:
    try:
        parse_size(value)
    except UptrainError as err:
        return str(err)
    return None


def _device_problem(value: str) -> str | None:
    return None if re.fullmatch(r"auto|cpu|cuda(:\d+)?", value) else f"{value!r} is not auto, cpu, cuda or cuda:N"


# Every seed uptrain takes: accelerate's set_seed seeds numpy too, whose legacy seeding takes
# 0 … 2**32 − 1 only. Checked with the other options, so that a bad seed is refused before a run
# writes its folder (where the corrected command would then need --overwrite).
SEED_RANGE = (0, 2**32 - 1)


def seed_option(help: str):
    """The `seed` key of a schema."""
    return option(0, at_least=SEED_RANGE[0], at_most=SEED_RANGE[1], help=help)


def kv_heads_option(default, help: str, **spelling):
    """The `num_kv_heads` key of a schema: one G (`uptrain convert`, `uptrain train`'s `source`)
    or several (`uptrain compare`), each at least 1."""
    return option(default, at_least=1, metavar="G", help=help, **spelling)


def _per_layer_problem(value: str) -> str | None:
    try:
        parse_kv_heads_per_layer(value)
    except UptrainError as err:
        return str(err)
    return None


Allocation = Literal["uniform", "calibrated"]
AllocationCost = Literal["loss", "merge"]


def kv_heads_per_layer_text(value):
    """A YAML list (`[8, 4, 4, 2]`, or one list per attention) as the flag spells it ("8,4,4,2", "8,4/2,2");
    a single layer's count (YAML reads `8` as a number) as "8"."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, (list, tuple)):
        return value
    lists = value if value and all(isinstance(v, (list, tuple)) for v in value) else [value]
    return "/".join(",".join(str(v) for v in heads) for heads in lists)


def distinct_heads(kv_heads_per_layer: str) -> set[str]:
    """The distinct KV-head counts of a --kv-heads-per-layer spelling ("4,1,1" or "4,4/2,2")."""
    return set(kv_heads_per_layer.replace("/", ",").split(","))


def kv_heads_per_layer_option(help: str = "each layer's KV heads"):
    """The `kv_heads_per_layer` key of a schema (`uptrain convert`, `uptrain train`'s `source`)."""
    return option(
        None,
        metavar="LISTS",
        before=kv_heads_per_layer_text,
        check=_per_layer_problem,
        help=f"{help}: a comma list, one entry per layer (8,4,4,2), each dividing that layer's KV heads; an "
        "encoder–decoder's converted attentions' lists split by / in model order (encoder, decoder-self, cross)",
    )


def kv_budget_option():
    """The `kv_budget` key of a schema."""
    return option(
        None,
        above=0,
        at_most=1,
        metavar="F",
        help="the output's KV cache as a fraction of the source's (0.25: a quarter): KV heads × head_dim summed "
        "over the converted attentions' layers; --allocation says how it is spent",
    )


def allocation_option():
    """The `allocation` key of a schema."""
    return option(
        "uniform",
        help="how --kv-budget is spent: uniform (one G for every layer, which must give F exactly) or calibrated "
        "(each layer's KV heads chosen by what its merge loses on calibration data)",
    )


def cross_kv_weight_option():
    """The `cross_kv_weight` key of a schema."""
    return option(
        None,
        above=0,
        metavar="R",
        help="encoder–decoders: what one cross-attention KV head weighs in --kv-budget, in self-attention heads: the "
        "source positions its cache holds per generated token (Whisper: 1,500 frames for ~40 tokens, about 37.5); "
        "default 1: every head alike",
    )


def allocation_cost_option():
    """The `allocation_cost` key of a schema."""
    return option(
        None,
        help="what --allocation calibrated minimises: loss (the model's loss on the calibration blocks with each "
        "layer alone merged to each G: layers × divisors forward passes; decoder-only) or merge (what each layer's "
        "calibrated merge loses, in closed form from the moments); default: loss for decoder-only models, merge "
        "for encoder–decoders",
    )


def parse_attention(value: str) -> tuple[str, ...]:
    """'cross,decoder-self' → ('decoder-self', 'cross'): the attentions named, in model order."""
    names = [part.strip() for part in value.split(",")]
    if unknown := [n for n in names if n not in STACK_KV_HEADS]:
        raise UptrainError(
            f"unknown attention {unknown[0]!r} in {value!r}; choose a comma list of {', '.join(STACK_KV_HEADS)}"
        )
    if len(set(names)) != len(names):
        raise UptrainError(f"attention list {value!r} names an attention twice")
    return tuple(a for a in STACK_KV_HEADS if a in names)


def _attention_problem(value: str) -> str | None:
    try:
        parse_attention(value)
    except UptrainError as err:
        return str(err)
    return None


POOLING_HELP = "how each group's heads become one"
GROUPING_HELP = (
    "which heads share a KV head: contiguous (query head i → KV head i // (h/G)) or similarity (heads "
    "renumbered exactly so that similar K/V heads are grouped; uses the calibration text when given)"
)


def calibrating_strategies() -> list[str]:
    """The registered strategies that read calibration data, as each says (`needs_calibration`;
    imports torch, as `strategies`)."""
    from uptrain.convert.pooling import STRATEGIES

    return [s.name for s in STRATEGIES.values() if s.needs_calibration]


@dataclass(kw_only=True)
class ConversionOptions(Schema):
    """How K/V heads are pooled: the keys every entry point shares (each also a `uptrain train` key)."""

    pooling: str = option("mean", help=POOLING_HELP, choices=strategies)
    grouping: Grouping = option("contiguous", help=GROUPING_HELP)
    attention: str = option(
        ",".join(DEFAULT_ATTENTIONS),
        metavar="LIST",
        check=_attention_problem,
        help="encoder–decoders: the attentions whose KV heads are pooled (-g, --kv-heads-per-layer, --kv-budget), "
        "a comma list of encoder, decoder-self "
        "and cross (default: the decoder's, the paper's choice); decoder-only models have decoder-self only",
    )
    calibration_tokens: int = option(
        32768,
        at_least=1,
        help="tokens of calibration text read through the source model (`calibrated` pooling, `similarity` grouping)",
    )
    calibration_device: str = option(
        "auto",
        metavar="auto|cpu|cuda[:N]",
        check=_device_problem,
        help="where calibration runs the source model: auto (the first GPU when there is one), cpu, cuda or cuda:N",
    )
    calibration_dtype: DType = option(
        "float32", help="dtype of calibration's forward pass (moments are accumulated in float64); bfloat16 for GPUs"
    )
    calibration_weighting: CalibrationWeighting = option(
        "uniform",
        help="what the calibrated merge weighs each error by: uniform (every position keys and values read, "
        "alike) or attention (encoder–decoders' decoder self- and cross-attention: the keys' error by the "
        "attention each position receives, the values' by the attention-pooled inputs the output reads)",
    )
    value_fit: ValueFit = option(
        "inputs",
        help="what the calibrated merge fits the values to: inputs (each value head on every position it reads) or "
        "output (encoder–decoders: after the keys are merged, the shared values and each head's o_proj map refit "
        "to each head's attention output under the merged keys; a second calibration pass)",
    )
    value_fit_blend: float = option(
        DEFAULT_VALUE_FIT_BLEND,
        at_least=0,
        metavar="LAMBDA",
        help="--value-fit output: the weight of the inputs fit blended into the output fit (large: the inputs fit's "
        "values; 0: the output fit alone, which can lean on directions the calibration barely visits)",
    )
    source_hash: SourceHash = option(
        "blake3",
        help="digest of each source file recorded in uptrain.json, computed "
        "beside the conversion; files from the Hub cache also get the "
        "Hub's sha256 for free, which sha256 checks",
    )


@dataclass(kw_only=True)
class ConversionSpec(ConversionOptions):
    """One conversion: a source checkpoint, the KV heads it becomes, and how."""

    source: str = option(
        positional=True, metavar="src", help="checkpoint folder (safetensors, single or sharded) or a Hub id"
    )
    target: Target = option(
        "gqa",
        help="what the attention becomes: gqa (fewer KV heads: -g, --kv-heads-per-layer or --kv-budget) or mla "
        "(multi-head latent attention in the DeepSeek-V2 layout, Llama family: --kv-rank or --kv-budget, --rope-dims)",
    )
    kv_rank: int | None = option(
        None,
        at_least=1,
        metavar="R",
        help="--target mla: the latent's rank (kv_lora_rank), cached per token with the shared rotary key",
    )
    rope_dims: int | None = option(
        None,
        at_least=2,
        metavar="D",
        help="--target mla: columns of the shared rotary key (qk_rope_head_dim; the source's first D/2 "
        "frequencies stay rotary, the rest lose their rotation); default: half the head dimension",
    )
    rope_stride: int = option(
        1,
        at_least=1,
        metavar="S",
        help="--target mla: the source's frequencies 0, S, 2S, … (every S-th from the highest) stay rotary, "
        "D/2 of them; the rest lose their rotation",
    )
    rope_residual: int = option(
        0,
        at_least=0,
        metavar="N",
        help="--target mla: of the kept rotary frequencies, the lowest N keep what the shared rotary key misses "
        "of each head's key as non-rotary columns of the latent (2 per frequency) instead of dropping it",
    )
    rotary_key: RotaryKey = option(
        "principal",
        help="--target mla: the one rotary key all heads share: principal (per frequency, the best complex "
        "rank-1 fit of the heads' rotary keys, each query head turned to read it), mean (the KV heads' mean) or "
        "calibrated (principal's fit weighted by the queries' energy on the calibration data: --mla-init calibrated)",
    )
    mla_init: MLAInit = option(
        "svd",
        help="--target mla: the latent's initialisation: svd (the joint SVD of the non-rotary keys and values in "
        "weight space) or calibrated (from their activations on --calibration-data, weighted by what the queries "
        "and o_proj read; the latent norm's weight set to the latent's measured rms)",
    )
    num_kv_heads: int | None = kv_heads_option(
        None,
        "KV heads after conversion, every layer alike; must divide the attention heads and the current KV heads "
        "(or give --kv-heads-per-layer, or --kv-budget)",
        flags=("-g",),
    )
    kv_heads_per_layer: str | None = kv_heads_per_layer_option("KV heads after conversion, layer by layer")
    kv_budget: float | None = kv_budget_option()
    allocation: Allocation = allocation_option()
    allocation_cost: AllocationCost | None = allocation_cost_option()
    cross_kv_weight: float | None = cross_kv_weight_option()
    seed: int = seed_option("seed of `random` pooling")
    dtype: DType | None = option(None, help="cast floating-point tensors (default: keep each tensor's dtype)")
    calibration_data: str | list[str] | None = option(
        None,
        metavar="FILE",
        help="calibration text: text/jsonl/parquet file(s) or a datasets name; required by calibrated pooling",
    )
    # Whisper's calibration targets open with the prompt training frames them with
    # (`uptrain.objectives.prompts`); `uptrain train` passes its own keys.
    language: str | None = option(
        None,
        help="Whisper calibration (speech pairs): the audio's language (en, fr, <|en|>), whose token opens every "
        "target as `generate(language=…)` forces it; default: the generation config's (or the tokenizer's)",
    )
    speech_task: Literal["transcribe", "translate"] | None = option(
        None, help="Whisper calibration (speech pairs): the task token after the language (default: the checkpoint's)"
    )
    # M2M100/NLLB's and multilingual Marian's calibration pairs carry the language codes training frames them with.
    source_lang: str | None = option(
        None,
        help="M2M100/NLLB calibration (pairs): the tokenizer's src_lang, the code its sources carry (eng_Latn; "
        "default: the tokenizer's saved one)",
    )
    target_lang: str | None = option(
        None,
        help="M2M100/NLLB calibration (pairs): the tokenizer's tgt_lang, the code each target starts with (default: "
        "the tokenizer's saved one); multilingual Marian: the `>>code<<` token written ahead of each source",
    )
    max_shard_size: int | str = option("5GB", check=_size_problem, help="largest output shard, e.g. 5GB or 500MiB")
    allow_pickle: bool = option(False, help="read pytorch_model*.bin checkpoints (with torch.load(weights_only=True))")
    # How calibration text is read: `uptrain train` and `uptrain compare` pass their data keys.
    calibration_dataset_config: str | None = option(None, flag=False, help="configuration of a Hub calibration dataset")
    calibration_split: str = option("train", flag=False, help="split of a Hub calibration dataset (streamed)")
    calibration_seq_len: int = option(256, at_least=2, flag=False, help="tokens per calibration block")
    # An encoder–decoder is calibrated on examples of the objective it is trained with: `uptrain
    # train` and `uptrain compare` pass theirs (an mBART trained on pairs calibrates on pairs).
    calibration_objective: str | None = option(
        None, flag=False, help="objective whose examples calibrate an encoder–decoder (default: the family's)"
    )
    text_field: str = option("text", flag=False, help="column holding the text in jsonl/parquet/Hub data")
    sample_by: Literal["line", "paragraph", "document"] = option("paragraph", flag=False, help="one document in .txt")

    def problems(self) -> list[str]:
        found = super().problems()
        if self.target == "mla":
            found += mla_problems(self)
        elif (
            self.kv_rank is not None
            or self.rope_dims is not None
            or self.rope_stride != 1
            or self.rope_residual
            or self.rotary_key != "principal"
            or self.mla_init != "svd"
        ):
            found.append(
                "--kv-rank, --rope-dims, --rope-stride, --rope-residual, --rotary-key and --mla-init shape a latent "
                "attention: give them with --target mla"
            )
        elif problem := kv_heads_problem(self.num_kv_heads, self.kv_heads_per_layer, self.kv_budget, self.allocation):
            found.append(problem)
        elif problem := allocation_cost_problem(self.allocation, self.allocation_cost):
            found.append(problem)
        elif problem := cross_kv_weight_problem(self.kv_budget, self.cross_kv_weight):
            found.append(problem)
        return found

    @property
    def kv_heads(self) -> KVHeadsRequest:
        """The KV heads asked for (-g, --kv-heads-per-layer or --kv-budget), for `resolve_allocation`."""
        return KVHeadsRequest.of(
            self.num_kv_heads, self.kv_heads_per_layer, self.kv_budget, self.allocation, self.cross_kv_weight
        )


# The keys of the GQA route, at their defaults, that --target mla does not take (calibration
# data it takes with --mla-init calibrated).
_GQA_ONLY = {
    "num_kv_heads": (None, "-g"),
    "kv_heads_per_layer": (None, "--kv-heads-per-layer"),
    "allocation": ("uniform", "--allocation"),
    "allocation_cost": (None, "--allocation-cost"),
    "cross_kv_weight": (None, "--cross-kv-weight"),
    "pooling": ("mean", "--pooling"),
    "grouping": ("contiguous", "--grouping"),
    "value_fit": ("inputs", "--value-fit"),
}


def mla_problems(spec: ConversionSpec) -> list[str]:
    """What `--target mla` refuses: the GQA route's keys, and a conversion without exactly one of
    --kv-rank and --kv-budget."""
    given = [flag for key, (default, flag) in _GQA_ONLY.items() if getattr(spec, key) != default]
    found = [f"--target mla takes --kv-rank or --kv-budget (and --rope-dims), not {', '.join(given)}"] if given else []
    if (spec.kv_rank is None) == (spec.kv_budget is None):
        found.append("--target mla needs one of --kv-rank R (the latent's rank) and --kv-budget F")
    if spec.rotary_key == "calibrated" and spec.mla_init != "calibrated":
        found.append("--rotary-key calibrated is fitted on calibration data: give it with --mla-init calibrated")
    if spec.mla_init == "calibrated" and spec.calibration_data is None:
        found.append("--mla-init calibrated needs calibration data (--calibration-data FILE)")
    elif spec.mla_init != "calibrated" and spec.calibration_data is not None:
        found.append(
            f"--mla-init {spec.mla_init} reads no calibration data: drop --calibration-data "
            "(or give --mla-init calibrated)"
        )
    return found


@dataclass(kw_only=True)
class KVHeadsKeys(Schema):
    """The keys that choose the KV heads, alone, as `ConversionSpec` declares them: `convert_model`
    checks its arguments by them, so a mistyped `allocation` or a budget of "0.5" is refused in one
    line as on the command line."""

    num_kv_heads: int | None = kv_heads_option(None, "KV heads after conversion, every layer alike")
    kv_heads_per_layer: str | None = kv_heads_per_layer_option()
    kv_budget: float | None = kv_budget_option()
    allocation: Allocation = allocation_option()
    allocation_cost: AllocationCost | None = allocation_cost_option()
    cross_kv_weight: float | None = cross_kv_weight_option()

    def problems(self) -> list[str]:
        found = super().problems()
        if problem := kv_heads_problem(self.num_kv_heads, self.kv_heads_per_layer, self.kv_budget, self.allocation):
            found.append(problem)
        elif problem := cross_kv_weight_problem(self.kv_budget, self.cross_kv_weight):
            found.append(problem)
        return found


@dataclass(frozen=True)
class CalibrationSettings:
    """How calibration reads its text and runs the source model: the `ConversionSpec` keys that both
    collectors (`calibration`: decoder-only, `calibration_seq2seq`: encoder–decoders) read, under
    their names. Defaults as the spec's."""

    calibration_tokens: int = 32768
    calibration_seq_len: int = 256  # tokens per block (at most the model's positions)
    text_field: str = "text"
    sample_by: str = "paragraph"
    calibration_device: str = "auto"  # auto: the first GPU when there is one
    calibration_dtype: str = "float32"  # of the forward pass; moments are float64
    calibration_weighting: str = "uniform"  # attention: encoder–decoders' attention-weighted moments too
    calibration_dataset_config: str | None = None  # a Hub dataset's configuration
    calibration_split: str = "train"  # a Hub dataset's split (streamed: only its first blocks are read)
    calibration_objective: str | None = None  # an encoder–decoder's examples (default: its family's objective)

    @classmethod
    def of(cls, spec) -> CalibrationSettings:
        """The settings a `ConversionSpec` gives (its keys of the same names)."""
        return cls(**{f.name: getattr(spec, f.name) for f in fields(cls)})

    @property
    def wanted_blocks(self) -> int:
        """How many blocks (examples) hold `calibration_tokens`, the last one counted whole."""
        return math.ceil(self.calibration_tokens / self.calibration_seq_len)


DEFAULT_CALIBRATION = CalibrationSettings()


@dataclass(kw_only=True)
class ConvertCommand(ConversionSpec):
    """`uptrain convert`: a conversion and where it goes."""

    out: str = option(positional=True, help="output folder; written to a temporary sibling and renamed when complete")
    overwrite: bool = option(False, help="replace OUT if it exists")

    def problems(self) -> list[str]:
        found = super().problems()
        calibrates = self.pooling in calibrating_strategies() or (
            self.grouping == "similarity" and self.calibration_data
        )
        keys = ("language", "speech_task", "source_lang", "target_lang")
        given = [f"--{k.replace('_', '-')}" for k in keys if getattr(self, k) is not None]
        if given and not calibrates:  # `uptrain train` frames its targets with them; a conversion only calibration
            found.append(
                f"{' and '.join(given)} choose the prompt of the calibration pairs' targets, and this conversion "
                f"calibrates nothing ({', '.join(f'--pooling {n}' for n in calibrating_strategies())}, or --grouping "
                "similarity with --calibration-data)"
            )
        return found + merge_key_problems(self)

    def spec(self) -> ConversionSpec:
        """The conversion alone."""
        return ConversionSpec(**{k: v for k, v in vars(self).items() if k not in ("out", "overwrite")})


# The keys that shape a calibrated merge (`merge_key_problems`), at their defaults: what a conversion
# that solves no merge (a compare's MLA runs) takes.
MERGE_DEFAULTS = {"calibration_weighting": "uniform", "value_fit": "inputs", "value_fit_blend": DEFAULT_VALUE_FIT_BLEND}


def merge_key_problems(spec: ConversionOptions, poolings: list[str] | None = None) -> list[str]:
    """--calibration-weighting and --value-fit shape a calibrated merge: refused with a pooling that
    solves none, and --value-fit-blend without --value-fit output (`uptrain convert`'s and `uptrain
    train`'s conversions alike; a compare's `poolings`, when none of them solves one, too: it
    applies the keys to its calibrated runs)."""
    found = []
    poolings = [spec.pooling] if poolings is None else poolings
    calibrating = calibrating_strategies()
    solves = any(p in calibrating for p in poolings)
    none = f"--pooling {' '.join(poolings)} solves none (drop it, or --pooling {' / '.join(calibrating)})"
    if spec.calibration_weighting != "uniform" and not solves:
        found.append(
            f"--calibration-weighting {spec.calibration_weighting} weighs the errors of a calibrated merge, and {none}"
        )
    if spec.value_fit != "inputs" and not solves:
        found.append(f"--value-fit {spec.value_fit} refits the values of a calibrated merge, and {none}")
    elif spec.value_fit == "inputs" and spec.value_fit_blend != DEFAULT_VALUE_FIT_BLEND:
        found.append("--value-fit-blend weighs the inputs fit within --value-fit output: give it with that")
    return found


def conversion_spec(**values) -> ConversionSpec:
    """A validated ConversionSpec; bad values raise one UptrainError naming every offending key."""
    return validated(ConversionSpec, "convert", **values)
