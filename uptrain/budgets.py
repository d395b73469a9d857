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


@dataclass(frozen=True)
class Budget:
    family: str
    model_types: tuple[str, ...]
    name: str  # regex searched (case-insensitive) in the checkpoint's name
    tokens: float
    source: str


BUDGETS: tuple[Budget, ...] = (
    Budget("Pythia", ("gpt_neox",), r"(^|[/_-])pythia-\d", 300e9,
           "Biderman et al. 2023: every size 300B tokens of the Pile (deduped: ~1.5 epochs of the deduped Pile)"),
    Budget("OPT", ("opt",), r"(^|[/_-])opt-\d", 180e9, "Zhang et al. 2022: 180B tokens"),
    Budget("GPT-J-6B", ("gptj",), r"gpt-j-6b", 402e9, "EleutherAI model card: 402B tokens of the Pile"),
    Budget("BLOOM-176B", ("bloom",), r"(^|/)bloom$", 366e9, "BigScience model card: 366B tokens"),
    Budget("Llama-2", ("llama",), r"llama-?2-\d+b", 2e12, "Touvron et al. 2023b: 2T tokens"),
    Budget("Llama-1 7B/13B", ("llama",), r"(^|[/_-])llama-(7|13)b", 1.0e12, "Touvron et al. 2023a: 1.0T tokens"),
    Budget("Llama-1 33B/65B", ("llama",), r"(^|[/_-])llama-(30|33|65)b", 1.4e12, "Touvron et al. 2023a: 1.4T tokens"),
)


def find_budget(config: dict, name: str) -> Budget | None:
    """The table row that identifies this checkpoint, or None."""
    model_type = str(config.get("model_type", "")).removesuffix("_gqa")  # converted by uptrain: same family
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
