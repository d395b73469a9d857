"""A whole-layer strategy says what it needs and what it rewrote: a second calibrating strategy,
registered through the real registry, takes `--language` as `calibrated` does, and the model
card's paragraph on the merge is its own (nothing asks for the name `calibrated`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.convert.test_calibrated import save
from tests.convert.test_calibrated_classic import build
from uptrain.cli import main
from uptrain.convert.pooling import STRATEGIES, CalibratedMerge, register
from uptrain.convert.spec import ConvertCommand
from uptrain.options import InvalidOptions, validated

if TYPE_CHECKING:
    from uptrain.convert.pooling import MergeCard


class TwinMerge(CalibratedMerge):
    """The calibrated merge under another name, with a card of its own."""

    name = "calibrated-twin"
    reference = "the calibrated merge under another name (a test's)"

    def card_text(self, card: MergeCard) -> str:
        return (
            f"`{self.name}` (a test's strategy) read {card.calibration}; it rewrote {card.rewritten} and the "
            f"`{card.o}` weights of {card.merged}{card.cast}."
        )


@pytest.fixture
def twin():
    strategy = register(TwinMerge())
    yield strategy
    del STRATEGIES[strategy.name]


def test_a_calibrating_strategy_takes_language(twin, tmp_path):
    keys = dict(source="src", out=str(tmp_path / "out"), num_kv_heads=2, language="en")
    assert validated(ConvertCommand, "convert", pooling=twin.name, **keys).pooling == twin.name
    with pytest.raises(InvalidOptions, match="calibrates nothing"):  # row pooling calibrates nothing
        validated(ConvertCommand, "convert", pooling="mean", **keys)


def test_the_card_says_what_the_strategy_rewrote(twin, tokenizer, calibration_text, capsys, tmp_path):
    src = save(build("opt", tokenizer), tokenizer, tmp_path / "src")
    out = tmp_path / "out"
    argv = ["convert", str(src), str(out), "-g", "2", "--pooling", twin.name, "--source-hash", "none"]
    assert main([*argv, "--calibration-data", str(calibration_text), "--calibration-tokens", "256"]) == 0, (
        capsys.readouterr().err
    )
    card = (out / "README.md").read_text()
    expected = (
        "`calibrated-twin` (a test's strategy) read 256 tokens of `text.jsonl`; it rewrote `q_proj`, `k_proj` "
        "and `v_proj` (weights and biases) and the `out_proj` weights of every layer."
    )
    assert expected in card and "`calibrated` merge" not in card and "pooled by" not in card, card[-1500:]
