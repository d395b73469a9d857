"""A `transformers.Trainer` checkpoint of a `*_gqa` model (what a user who fine-tunes a converted
checkpoint with the usual tools gets) carries the modeling code, so it loads in a fresh process
without uptrain, through `trust_remote_code`, with the trained model's logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import uptrain.modeling  # noqa: F401  (registers gpt2_gqa, opt_gqa, … as a user's `import uptrain` does)
from tests.modeling.classic_models import build, token_ids
from uptrain.architecture.converted import modeling_files
from uptrain.convert import convert_checkpoint

STEPS = 2

RELOAD_WITHOUT_UPTRAIN = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({folder!r}, trust_remote_code=True).eval()
assert type(model).__module__.startswith('transformers_modules.'), type(model).__module__
with torch.no_grad():
    torch.save(model(torch.tensor({ids!r})).logits, {logits!r})
assert not [m for m in sys.modules if m.split('.')[0] == 'uptrain'], 'uptrain was imported'
"""


class Blocks(torch.utils.data.Dataset):
    """A few fixed blocks of token ids, their own labels (causal LM)."""

    def __init__(self, vocab_size: int, count: int = 8, length: int = 16):
        self.ids = torch.randint(3, vocab_size, (count, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@pytest.mark.parametrize("model_type", ["gpt2", "opt"])
def test_a_trainer_checkpoint_loads_without_uptrain(model_type, tmp_path):
    build(model_type).save_pretrained(tmp_path / "src")
    converted = convert_checkpoint(tmp_path / "src", tmp_path / "converted", 2, progress=False)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    assert not type(model).__module__.startswith("transformers_modules.")  # uptrain's registered class
    with torch.no_grad():
        before = model.eval()(token_ids()).logits

    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        max_steps=STEPS,
        save_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        use_cpu=True,
        report_to=[],
        logging_steps=STEPS,
        seed=0,
        disable_tqdm=True,
    )
    Trainer(model=model.train(), args=args, train_dataset=Blocks(model.config.vocab_size)).train()
    checkpoint = tmp_path / "trainer" / f"checkpoint-{STEPS}"
    with torch.no_grad():
        expected = model.eval()(token_ids()).logits
    assert not torch.equal(expected, before)  # trained: the checkpoint holds new weights

    for name, path in modeling_files(f"{model_type}_gqa").items():
        assert (checkpoint / name).read_bytes() == path.read_bytes(), name
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["auto_map"] == json.loads((converted / "config.json").read_text())["auto_map"]

    # A fresh interpreter that cannot import uptrain: PYTHONPATH an empty folder, run from
    # another folder (`python -c` puts the working folder on sys.path), its own HF cache.
    empty = tmp_path / "empty"
    empty.mkdir()
    logits = tmp_path / "logits.pt"
    script = RELOAD_WITHOUT_UPTRAIN.format(folder=str(checkpoint), ids=token_ids().tolist(), logits=str(logits))
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), PYTHONPATH=str(empty))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=empty, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert torch.equal(torch.load(logits), expected)
