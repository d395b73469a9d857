"""What a conversion writes besides the weights says what was done: Hub metadata the Hub and
huggingface_hub read, a card true for each strategy, the source's licence files, and
provenance that records the groups actually merged and the Hub commit."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file

from tests.convert.tiny_models import build_model, save
from uptrain.convert import convert_checkpoint
from uptrain.convert.pipeline import Calibration

LICENCE_FILES = {"LICENSE": "Apache License 2.0, the full text\n", "USE_POLICY.md": "# Acceptable use\n",
                 "NOTICE": "Copyright the authors\n"}
SOURCE_CARD = """---
license: other
license_name: tiny-community-license
license_link: LICENSE
language: [en]
---
# A tiny model
"""


def state(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A tiny Llama (8 heads, 2 layers) published with a card, a licence, a use policy and a notice."""
    folder = save(build_model("llama"), tmp_path_factory.mktemp("src") / "llama")
    (folder / "README.md").write_text(SOURCE_CARD)
    for name, text in LICENCE_FILES.items():
        (folder / name).write_text(text)
    return folder


def test_card_metadata_is_read_by_huggingface_hub_and_licence_files_are_carried(src, tmp_path):
    out = convert_checkpoint(src, tmp_path / "out", 2, progress=False)
    card = ModelCard.load(out / "README.md")  # a local file: no network
    assert card.data.base_model == str(src)
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert (card.data.license, card.data.license_name, card.data.license_link) == ("other", "tiny-community-license",
                                                                                   "LICENSE")
    assert {"uptrain", "grouped-query-attention", "llama"} <= set(card.data.tags)
    for name in LICENCE_FILES:
        assert (out / name).read_bytes() == (src / name).read_bytes()


def test_a_source_without_card_gives_a_card_without_licence(tmp_path):
    bare = save(build_model("qwen2"), tmp_path / "bare")
    out = convert_checkpoint(bare, tmp_path / "out", 4, progress=False)
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == str(bare) and card.data.license is None
    assert not list(out.glob("LICENSE*"))


def test_mean_card_says_q_and_o_are_unchanged_and_they_are(src, tmp_path):
    out = convert_checkpoint(src, tmp_path / "out", 2, progress=False)
    text = (out / "README.md").read_text()
    assert "Each contiguous group of 4 source KV heads became one" in text
    assert "`q_proj`, `o_proj` and every other tensor are copied unchanged" in text
    before, after = state(src), state(out)
    for name in before:
        if "k_proj" not in name and "v_proj" not in name:
            assert torch.equal(before[name], after[name]), name


def test_calibrated_similarity_card_says_q_and_o_are_rewritten_and_they_are(src, tmp_path):
    # A positive definite second moment, as calibration would give (its origin does not matter here).
    torch.manual_seed(0)
    hidden = 64
    mix = torch.randn(hidden + 1, hidden + 1, dtype=torch.float64)
    moments = {layer: mix @ mix.T / hidden for layer in range(2)}
    out = convert_checkpoint(src, tmp_path / "out", 2, pooling="calibrated", grouping="similarity",
                             calibration=Calibration(moments, {"data": "synthetic", "tokens": 4096}), progress=False)
    text = (out / "README.md").read_text()
    assert "contiguous" not in text and "`q_proj`, `o_proj` and every other tensor" not in text
    assert "`q_proj`, `k_proj`, `v_proj` and `o_proj` (weights and biases) of every layer are rewritten" in text
    assert "run over 4,096 tokens of `synthetic`" in text and "renumbered" in text
    before, after = state(src), state(out)
    for layer in range(2):
        for proj in ("q_proj", "o_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            assert not torch.equal(before[name], after[name]), name
    untouched = [n for n in before if ".self_attn." not in n]
    assert untouched and all(torch.equal(before[n], after[n]) for n in untouched)


def test_kv_groups_are_the_groups_merged_under_similarity_grouping(src, tmp_path):
    """Mean pooling with similarity grouping: each new K head is the mean of exactly the source
    heads that `kv_groups` names for its layer."""
    out = convert_checkpoint(src, tmp_path / "out", 2, grouping="similarity", progress=False)
    record = json.loads((out / "uptrain.json").read_text())
    groups = record["kv_groups"]
    assert sorted(groups) == ["0", "1"]
    assert groups != {str(layer): [[0, 1, 2, 3], [4, 5, 6, 7]] for layer in range(2)}  # not the contiguous ones
    before, after = state(src), state(out)
    d = 8
    for layer, layer_groups in groups.items():
        assert sorted(h for g in layer_groups for h in g) == list(range(8))
        assert [h for g in layer_groups for h in g] == record["kv_head_order"][layer]
        for proj in ("k_proj", "v_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            heads = before[name].view(8, d, -1)
            expected = torch.cat([heads[g].mean(dim=0) for g in layer_groups])
            torch.testing.assert_close(after[name], expected, rtol=0, atol=1e-7)


def test_contiguous_kv_groups_and_no_revision_for_a_local_folder(src, tmp_path):
    record = json.loads((convert_checkpoint(src, tmp_path / "out", 2, progress=False) / "uptrain.json").read_text())
    assert record["kv_groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and record["grouping"] == "contiguous"
    assert record["source_revision"] is None and "kv_head_order" not in record


def test_hub_source_records_its_revision(src, tmp_path):
    """A Hub id found in the local cache (HF_HUB_OFFLINE): the snapshot's commit is recorded,
    in provenance and on the card."""
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = os.path.join(constants.HF_HUB_CACHE, "models--tiny-org--tiny-llama")
    snapshot = os.path.join(repo, "snapshots", commit)
    shutil.copytree(src, snapshot)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(commit)
    out = convert_checkpoint("tiny-org/tiny-llama", tmp_path / "out", 4, progress=False)
    record = json.loads((out / "uptrain.json").read_text())
    assert record["source"] == "tiny-org/tiny-llama" and record["source_revision"] == commit
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "tiny-org/tiny-llama" and commit in card.text


def test_a_folder_in_the_hub_cache_is_named_by_its_hub_id_on_the_card(src, tmp_path):
    snapshot = tmp_path / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / ("f" * 40)
    shutil.copytree(src, snapshot)
    out = convert_checkpoint(snapshot, tmp_path / "out", 4, progress=False)
    assert ModelCard.load(out / "README.md").data.base_model == "tiny-org/tiny-llama"
