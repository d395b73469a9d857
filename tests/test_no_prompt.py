"""No command ever asks a question: a converted `*_gqa` folder names its modeling files in
`auto_map`, and transformers prompts on the terminal ("Do you wish to run the custom code?
[y/N]") whenever a loader is given no `trust_remote_code` and the folder's model_type is not
registered. Every loader is `uptrain.loading`'s, which never trusts a folder's code: tested for
every `*_gqa` type with uptrain's modeling unregistered, and `--json` tested to print exactly one
JSON object for every command that has it (on Marian's conversion: the issue's case), each run
with stdin closed and a timeout, so a prompt can neither pass unseen nor wait."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, MBartConfig, MBartForConditionalGeneration

from tests.convert.test_encoder_decoder import BART_GEOMETRY
from tests.modeling.classic_models import CONFIGS, SHARED
from tests.train.test_seq2seq import WORDS, build_model, build_tokenizer, write_jsonl
from tests.train.train_helpers import make_text
from uptrain.architecture import CONVERTED
from uptrain.convert import convert_checkpoint

ENCODER_DECODERS = ("t5", "umt5", "bart", "marian", "m2m_100", "pegasus", "whisper")  # test_seq2seq's builders


# The Llama family's converted type (nemotron-nas) is its per-layer layout: a tiny Llama, converted
# with layers of different KV heads (at one G it stays a plain llama).
LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
PER_LAYER = {"llama": "4,2"}


def _decoder_only(model_type: str, folder: Path, tokenizer) -> Path:
    settings = LLAMA if model_type == "llama" else CONFIGS[model_type]
    config = AutoConfig.for_model(model_type, **{**settings, **SHARED, "vocab_size": len(tokenizer)})
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _mbart(folder: Path, tokenizer) -> Path:
    geometry = {**BART_GEOMETRY, "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id}
    MBartForConditionalGeneration(MBartConfig(**geometry)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def conversions(tmp_path_factory) -> dict[str, Path]:
    """Every `*_gqa` type, converted at G = h from a tiny source saved with a word-level tokenizer."""
    root = tmp_path_factory.mktemp("no-prompt")
    tokenizer = build_tokenizer(make_text(1, 40) + " " + " ".join(WORDS), sentinels=False)
    torch.manual_seed(0)
    found = {}
    for gqa_type, record in sorted(CONVERTED.items()):  # each converted type from its first source
        source_type = record.model_type
        src = root / source_type
        if source_type in ENCODER_DECODERS:
            build_model(source_type, src, tokenizer)
        elif source_type == "mbart":
            _mbart(src, tokenizer)
        else:
            _decoder_only(source_type, src, tokenizer)
        heads = json.loads((src / "config.json").read_text())
        g = next(
            heads[k]
            for k in ("decoder_attention_heads", "num_heads", "n_head", "n_heads", "num_attention_heads")
            if k in heads
        )
        if source_type in PER_LAYER:
            kv = {"kv_heads_per_layer": PER_LAYER[source_type]}
            found[gqa_type] = convert_checkpoint(src, root / gqa_type, None, progress=False, **kv)
        else:
            found[gqa_type] = convert_checkpoint(src, root / gqa_type, g, progress=False)
        assert json.loads((found[gqa_type] / "config.json").read_text())["model_type"] == gqa_type
    return found


def run(argv: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python <argv>` with stdin closed (not a terminal): a prompt would read end-of-file, a
    wait would hit the timeout."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(Path(__file__).parents[1]))
    return subprocess.run(
        [sys.executable, *argv],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


LOAD_EVERY_FOLDER = """
import sys
from uptrain import UptrainError
from uptrain.data.pairs import _load_feature_extractor
from uptrain.loading import load_model, load_tokenizer
for folder in sys.argv[1:]:
    assert load_tokenizer(folder, "model").eos_token_id is not None
    try:  # unregistered, the model is one line, never a question
        load_model(folder, "model", weights=False)
    except UptrainError as err:
        assert "\\n" not in str(err), err
    if folder.endswith("whisper_gqa"):
        _load_feature_extractor(folder)
assert "uptrain.modeling" not in sys.modules
"""


def test_loaders_never_prompt_for_any_converted_type(conversions, tmp_path):
    assert set(conversions) == set(CONVERTED)
    done = run(["-c", LOAD_EVERY_FOLDER, *map(str, conversions.values())], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "", done.stdout[:3000]


@pytest.mark.parametrize("command", ["inspect", "speed", "evaluate"])
def test_json_is_one_object_and_nothing_else(command, conversions, tmp_path):
    model = str(conversions["marian_gqa"])
    pairs = write_jsonl(tmp_path / "qa.jsonl", [{"source": w, "target": w.split()[-1]} for w in WORDS[:3]])
    extra = {
        "inspect": [],
        "speed": ["--context", "8", "--new-tokens", "2", "--repeats", "1"],
        "evaluate": ["--task", "qa", "--data", str(pairs), "--max-new-tokens", "2"],
    }[command]
    done = run(["-m", "uptrain", command, model, *extra, "--json"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    decoder = json.JSONDecoder()
    value, end = decoder.raw_decode(done.stdout.lstrip())
    assert isinstance(value, dict) and done.stdout.lstrip()[end:].strip() == "", done.stdout[:3000]
