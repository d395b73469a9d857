"""Published pretraining budgets (tokens) of well-known model families, as data.

The uptraining budget is a fraction α of the original pretraining (GQA paper §2.1), so a
checkpoint whose family is recognised needs only `--uptrain-fraction`. A family is recognised
by its checkpoint name (a Hub id such as "EleutherAI/pythia-160m", a folder name, or the
config's `_name_or_path`) together with its `model_type`, so that a fine-tune named after a
family but of another architecture is not mistaken for it. Unknown: None, and the caller
asks for the budget.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from uptrain import UptrainError
from uptrain.architecture import source_model_type
from uptrain.checkpoint.provenance import conversion_record, read_provenance
from uptrain.checkpoint.source import resolve_source
from uptrain.model_info import read_config
from uptrain.options import Schema, option
from uptrain.strict_json import read_json


@dataclass(frozen=True)
class Budget:
    family: str
    model_types: tuple[str, ...]
    name: str  # regex searched (case-insensitive) in the checkpoint's name
    tokens: float
    source: str


BUDGETS: tuple[Budget, ...] = (
    Budget(
        "Pythia",
        ("gpt_neox",),
        r"(^|[/_-])pythia-\d",
        300e9,
        "Biderman et al. 2023: every size 300B tokens of the Pile (deduped: ~1.5 epochs of the deduped Pile)",
    ),
    Budget("OPT", ("opt",), r"(^|[/_-])opt-\d", 180e9, "Zhang et al. 2022: 180B tokens"),
    Budget("GPT-J-6B", ("gptj",), r"gpt-j-6b", 402e9, "EleutherAI model card: 402B tokens of the Pile"),
    Budget("BLOOM-176B", ("bloom",), r"(^|/)bloom$", 366e9, "BigScience model card: 366B tokens"),
    # EleutherAI's model cards: each GPT-Neo size its own number of tokens of the Pile.
    Budget("GPT-Neo 125M", ("gpt_neo",), r"gpt-neo-125m", 300e9, "EleutherAI model card: 300B tokens of the Pile"),
    Budget("GPT-Neo 1.3B", ("gpt_neo",), r"gpt-neo-1\.3b", 380e9, "EleutherAI model card: 380B tokens of the Pile"),
    Budget("GPT-Neo 2.7B", ("gpt_neo",), r"gpt-neo-2\.7b", 420e9, "EleutherAI model card: 420B tokens of the Pile"),
    # MPT-7B-8k continued MPT-7B for 500B tokens more: not this row.
    Budget("MPT-7B", ("mpt",), r"(^|[/_-])mpt-7b(?!-8k)", 1e12, "MosaicML model card: 1T tokens of text and code"),
    Budget("Llama-2", ("llama",), r"llama-?2-\d+b", 2e12, "Touvron et al. 2023b: 2T tokens"),
    Budget("Llama-1 7B/13B", ("llama",), r"(^|[/_-])llama-(7|13)b", 1.0e12, "Touvron et al. 2023a: 1.0T tokens"),
    Budget("Llama-1 33B/65B", ("llama",), r"(^|[/_-])llama-(30|33|65)b", 1.4e12, "Touvron et al. 2023a: 1.4T tokens"),
)


def find_budget(config: dict, name: str) -> Budget | None:
    """The table row that identifies this checkpoint, or None."""
    model_type = source_model_type(config.get("model_type"))  # converted by uptrain: the source's family
    names = [n for n in (name, config.get("_name_or_path")) if n]
    for budget in BUDGETS:
        if model_type in budget.model_types and any(re.search(budget.name, str(n), re.IGNORECASE) for n in names):
            return budget
    return None


def known_pretrain_tokens(config: dict, name: str) -> float | None:
    """Pretraining tokens published for this checkpoint's family, or None when not recognised.

    `config` is the checkpoint's config.json; `name` its Hub id or folder name. GPT-2's budget
    was never published (WebText, ~8M documents), so GPT-2 is never recognised.
    """
    budget = find_budget(config, name)
    return None if budget is None else budget.tokens


# A model uptrain pretrained itself (the shipped reference model) records its budget here.
REFERENCE_CARD = "reference.json"


def pretrain_tokens(model: str) -> float:
    """The pretraining tokens of `model` (a checkpoint folder or Hub id), for `uptrain_fraction`:
    its `reference.json` card when it has one, else the published budget of its family,
    recognised by its name or, for a checkpoint uptrain converted, by its source's name.
    `uptrain train` and `uptrain compare` both ask this; one UptrainError when it cannot tell."""
    folder = resolve_source(model).folder
    card = folder / REFERENCE_CARD
    if card.is_file():
        tokens = read_json(card)
        tokens = tokens.get("pretrain_tokens") if isinstance(tokens, dict) else None
        if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or not 0 < tokens < float("inf"):
            raise UptrainError(f"{card}: `pretrain_tokens` must be a positive number of tokens")
        return float(tokens)
    config = read_config(folder)
    conversion = conversion_record(read_provenance(folder))
    names = [model] + ([conversion["source"]] if conversion and isinstance(conversion.get("source"), str) else [])
    for name in names:
        if (tokens := known_pretrain_tokens(config, name)) is not None:
            return tokens
    families = ", ".join(b.family for b in BUDGETS)
    raise UptrainError(
        f"`uptrain_fraction` needs `pretrain_tokens`: {model} has no {REFERENCE_CARD} card and is not "
        f"recognised as a family with a published pretraining budget ({families})"
    )


# How long to uptrain: the keys and the rule `uptrain train` and `uptrain compare` share.
BUDGET = "budget: exactly one of max_steps, max_tokens, uptrain_fraction"


@dataclass(kw_only=True)
class UptrainingBudget(Schema):
    """The budget keys of `uptrain train` (`TrainConfig` embeds them) and `uptrain compare`."""

    max_steps: int | None = option(None, at_least=1, group=BUDGET, help="optimizer steps to train")
    max_tokens: int | None = option(
        None, at_least=1, group=BUDGET, help="tokens to train on (rounded up to whole steps)"
    )
    uptrain_fraction: float | None = option(
        None,
        above=0,
        at_most=1,
        group=BUDGET,
        help="α: share of the original pretraining tokens to uptrain for (paper: 0.05)",
    )
    pretrain_tokens: float | None = option(
        None,
        above=0,
        group=BUDGET,
        help=f"tokens the model was pretrained on (e.g. 2e12 for Llama-2); with "
        f"uptrain_fraction; default: its {REFERENCE_CARD} card, else the "
        f"published budget of a known family "
        f"({', '.join(b.family for b in BUDGETS)})",
    )

    def problems(self) -> list[str]:
        return super().problems() + budget_problems(self)


def budget_problems(budget) -> list[str]:
    """The one budget rule, for anything with the four budget keys (`UptrainingBudget`,
    `TrainConfig`): exactly one budget; `pretrain_tokens` only with `uptrain_fraction`, and
    without it `pretrain_tokens(model)` finds it once the model is known."""
    given = [name for name in ("max_steps", "max_tokens", "uptrain_fraction") if getattr(budget, name) is not None]
    if len(given) != 1:
        return [
            f"give exactly one budget: `max_steps`, `max_tokens`, or `uptrain_fraction` (with `pretrain_tokens` "
            f"unless the model has a {REFERENCE_CARD} card or a known family) (got {', '.join(given) or 'none'})"
        ]
    if budget.pretrain_tokens is not None and budget.uptrain_fraction is None:
        return ["`pretrain_tokens` only applies with `uptrain_fraction`"]
    return []
