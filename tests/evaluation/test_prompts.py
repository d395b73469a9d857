"""`uptrain evaluate` with the family's prompt (issue #25): the keys are train's (`--language`,
`--speech-task`, `--source-lang`, `--target-lang`), the targets are read with train's framing, and
generation starts with the prompt users force — Whisper's <|startoftranscript|><|lang|><|task|>
<|notimestamps|>, mBART's / NLLB's target code. Tiny real models and tokenizers as
tests/train/test_target_prompts.py builds them; the generated ids are checked as `generate` returns
them under the settings evaluate generates with."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.evaluation.models import convert, evaluate_json
from tests.train.test_target_prompts import (
    MULTILINGUAL_FR,
    PAIRS,
    build_translation_model,
    build_whisper,
    write_jsonl,
)
from uptrain.cli import main


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("evalprompt")
    paths = {kind: build_translation_model(kind, root / kind) for kind in ("mbart", "mbart50", "nllb")}
    paths["whisper"] = build_whisper(root / "whisper", True)
    paths["english"] = build_whisper(root / "english", False)
    # QA pairs: the text task the main environment scores (no metric library needed).
    paths["qa"] = write_jsonl(root / "qa.jsonl", [{"source": s, "target": t} for s, t in PAIRS])
    return paths


def framing_and_settings(path, objective: str, **keys):
    """Train's framing of `path` with `keys`, the model, and the settings evaluate generates with."""
    from transformers import AutoTokenizer

    from uptrain.architecture import find_architecture
    from uptrain.evaluation.generation import generation_settings
    from uptrain.model_info import read_config
    from uptrain.objectives import OBJECTIVES
    from uptrain.objectives.prompts import PromptKeys, target_framing
    from uptrain.speed import load_model

    config, tokenizer = read_config(path), AutoTokenizer.from_pretrained(path)
    arch = find_architecture(config["model_type"])
    framing = target_framing(arch, OBJECTIVES[objective], PromptKeys(**keys), tokenizer, str(path), config)
    model = load_model(path, "float32", torch.device("cpu"))
    return framing, model, tokenizer, generation_settings(model, tokenizer, 3, framing)


@pytest.mark.parametrize("language", ["fr", "en"])
def test_whisper_generation_starts_with_the_prompt_its_targets_carry(models, language):
    framing, model, tokenizer, settings = framing_and_settings(models["whisper"], "speech_pairs", language=language)
    prompt = ["<|startoftranscript|>", f"<|{language}|>", "<|transcribe|>", "<|notimestamps|>"]
    assert framing.shown == "".join(prompt)
    with torch.inference_mode():
        out = model.generate(torch.zeros(1, 16, 100), generation_config=settings, return_dict_in_generate=True)
    ids = out.sequences[0].tolist()
    assert tokenizer.convert_ids_to_tokens(ids[:4]) == prompt
    # The decoder input after the start is the labels' prefix: what the model was trained to follow.
    assert tuple(ids[1:4]) == framing.label_prefix
    assert prompt == MULTILINGUAL_FR or language == "en"


def test_every_clip_gets_one_greedy_transcript(models, tmp_path):
    """Whisper's generate takes every token after <|notimestamps|> for a timestamp (this tokenizer's
    words are, as a real Whisper's 1,501 timestamp tokens are) and, when a decode holds two in a
    row, seeks on in the clip's 30 s window and decodes again: a clip's prediction was several
    decodes joined (and with return_dict_in_generate only the last pass's clips came back, fewer
    than the batch). Evaluate decodes each clip once: exactly one prediction per clip, in order,
    each the greedy continuation of the prompt (at most --max-new-tokens), computed here by hand."""
    from tests.train.test_seq2seq import TONES, write_wav
    from uptrain.data.pairs import load_pairs
    from uptrain.evaluation.generation import generate_predictions
    from uptrain.model_info import read_config
    from uptrain.objectives import OBJECTIVES

    (tmp_path / "audio").mkdir()
    for name, hz in TONES.items():
        write_wav(tmp_path / "audio" / f"{name}.wav", hz)
    rows = [{"audio": f"audio/{name}.wav", "text": name} for name in [*TONES, "low", "high"]]
    data = write_jsonl(tmp_path / "speech.jsonl", rows)
    path = models["whisper"]
    framing, model, tokenizer, _ = framing_and_settings(path, "speech_pairs", language="en")
    timestamp_begin = model.generation_config.no_timestamps_token_id + 1
    with torch.no_grad():  # the special tokens' logits 0 (their output embeddings, tied): the random model writes words
        model.get_output_embeddings().weight[:timestamp_begin] = 0.0
    examples = load_pairs(
        str(data), "data", OBJECTIVES["speech_pairs"], tokenizer, str(path), read_config(path), 32, 16, framing
    )
    new = 4
    predictions, _ = generate_predictions(
        model, tokenizer, examples, batch_size=2, max_new_tokens=new, device=torch.device("cpu"), framing=framing
    )
    start = [model.config.decoder_start_token_id, *framing.label_prefix]
    expected = []
    with torch.inference_mode():
        for i in range(len(rows)):
            features = examples.take([i])["input_features"]
            ids = list(start)
            for _ in range(new):
                logits = model(input_features=features, decoder_input_ids=torch.tensor([ids])).logits
                ids.append(int(logits[0, -1].argmax()))
                if ids[-1] == tokenizer.eos_token_id:
                    break
            expected.append(tokenizer.decode(ids[len(start) :], skip_special_tokens=True).strip())
    assert predictions == expected
    # The case in point: greedy decoding here emits words, which Whisper's generate read as timestamps.
    assert any(
        len(p.split()) >= 2 and tokenizer.convert_tokens_to_ids(p.split()[0]) >= timestamp_begin for p in expected
    )


@pytest.mark.parametrize(
    ("kind", "code", "start"),
    [("mbart50", "fr_XX", "eos"), ("nllb", "spa_Latn", "eos"), ("mbart", "fr_XX", None)],
)
def test_translation_generation_starts_with_the_target_code(models, kind, code, start):
    """NLLB and mBART-50: EOS, then the code forced first (`forced_bos_token_id`); mBART-cc25, whose
    labels end with the code: the code as the decoder start, as its shift wraps it round."""
    framing, model, tokenizer, settings = framing_and_settings(models[kind], "pairs", target_lang=code)
    code_id = tokenizer.convert_tokens_to_ids(code)
    assert code_id != model.generation_config.decoder_start_token_id  # not the checkpoint's own target
    with torch.inference_mode():
        out = model.generate(torch.tensor([[5, 6, tokenizer.eos_token_id]]), generation_config=settings)
    expected = [tokenizer.eos_token_id, code_id] if start == "eos" else [code_id]
    assert out[0, : len(expected)].tolist() == expected
    assert model.generation_config.forced_bos_token_id is None  # the settings are a copy


def test_evaluate_reads_and_generates_with_the_keys(models, tmp_path, capsys):
    """`--source-lang`/`--target-lang` reach train's framing (the prompt shown, the sources' code)
    and the generation (its predictions differ from the checkpoint's own codes'); a G = h
    conversion scores exactly what its source scores under the same prompt."""
    args = ("--task", "qa", "--data", str(models["qa"]), "--max-new-tokens", "4")
    keys = ("--source-lang", "deu_Latn", "--target-lang", "spa_Latn")
    source = evaluate_json(str(models["nllb"]), *args, *keys, capsys=capsys)
    assert source["prompt"] == "deu_Latn → spa_Latn" and source["examples"] == len(PAIRS)
    plain = evaluate_json(str(models["nllb"]), *args, capsys=capsys)
    assert plain["prompt"] == "eng_Latn → fra_Latn"
    assert [p["prediction"] for p in plain["predictions"]] != [p["prediction"] for p in source["predictions"]]
    converted = evaluate_json(str(convert(models["nllb"], tmp_path / "nllb-gqa", 4)), *args, *keys, capsys=capsys)
    assert converted["predictions"] == source["predictions"] and converted["scores"] == source["scores"]
    assert converted["prompt"] == source["prompt"]


def test_the_keys_are_trains(models):
    """Declared once: evaluate's prompt keys are train's (help, choices) and `PromptKeys`' fields."""
    from uptrain.evaluation.run import PROMPT_KEYS, EvaluateOptions
    from uptrain.objectives.prompts import PromptKeys
    from uptrain.options import keys_of
    from uptrain.train.config import TrainData

    assert PROMPT_KEYS == tuple(f.name for f in dataclasses.fields(PromptKeys))
    train = {k.name: k for k in keys_of(TrainData)}
    for key in keys_of(EvaluateOptions):
        if key.name in PROMPT_KEYS:
            assert key.option == train[key.name].option and key.annotation == train[key.name].annotation


@pytest.mark.parametrize(
    ("model", "args", "message"),
    [
        ("nllb", ["--language", "fr"], "`language` applies to Whisper checkpoints (speech_pairs); "),
        ("nllb", ["--target-lang", "xx_Yyyy"], "`target_lang` 'xx_Yyyy' is not a language code of the tokenizer"),
        ("mbart", ["--speech-task", "summarize"], "`speech_task`: must be one of 'transcribe', 'translate'"),
        ("nllb", ["--task", "lm-eval:x", "--target-lang", "spa_Latn"], "`target_lang`: an lm-eval task writes its own"),
    ],
)
def test_prompt_refusals_are_one_line_and_write_nothing(models, tmp_path, capsys, model, args, message):
    task = [] if "--task" in args else ["--task", "qa", "--data", str(models["qa"])]
    out = tmp_path / "out"
    assert main(["evaluate", str(models[model]), *task, *args, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_whisper_refusals_are_trains(models):
    """A multilingual Whisper without a language, a key an English-only one does not take: the
    refusals `uptrain train` gives, reached by evaluate before its model loads (with the metric
    library installed, test_metric_libraries.py runs them through `uptrain evaluate --task asr`)."""
    from uptrain import UptrainError
    from uptrain.evaluation.run import EvaluateOptions, _framing
    from uptrain.evaluation.tasks import get_task

    def framing(kind: str, **keys):
        from transformers import AutoTokenizer

        from uptrain.model_info import read_config

        options = EvaluateOptions(model=str(models[kind]), task="asr", data="x.jsonl", **keys)
        path = models[kind]
        return _framing(options, get_task("asr"), AutoTokenizer.from_pretrained(path), path, read_config(path))

    assert framing("whisper", language="fr").shown == "".join(MULTILINGUAL_FR)
    with pytest.raises(UptrainError, match="is a multilingual Whisper and its generation config names no language"):
        framing("whisper")
    with pytest.raises(UptrainError, match="is an English-only Whisper .* it takes no `language`"):
        framing("english", language="en")
    assert json.loads((models["english"] / "generation_config.json").read_text())["is_multilingual"] is False
