"""The prompt a family's targets begin with, so that the labels are what users decode with.

A model that `generate()` starts with forced tokens learns and is measured on targets that start
with them too: otherwise an α = 0 evaluation scores the model on sequences it never produces, and
uptraining teaches it to skip the prompt that users' `generate()` forces. What a family's targets
begin with is its record's `target_prompt` (`uptrain.architecture.TargetPrompt`); this module
builds it from the checkpoint and the run's keys, refusing in one line what does not apply:

- Whisper (`language`, `speech_task`): `<|startoftranscript|><|lang|><|task|><|notimestamps|>`, the ids
  `generate(language=…, task=…)` forces, from generation_config.json (`lang_to_id`, `task_to_id`,
  `no_timestamps_token_id`, `is_multilingual`; the defaults from its `language` and `task`, the
  tokenizer's, or its `forced_decoder_ids`). The model puts the decoder start in front of the
  labels itself, so the labels are the rest of the prompt, the transcript and <|endoftext|>: an
  English-only checkpoint's `<|notimestamps|>`, a multilingual one's language and task tokens
  before it.
- mBART / M2M100 / NLLB (`source_lang`, `target_lang`): the tokenizer's `src_lang` / `tgt_lang`,
  whose codes it writes itself (the target's first, where `forced_bos_token_id` puts it; mBART-cc25's
  last, which its decoder start wraps round to the front); default: the tokenizer's saved ones.
- Multilingual Marian (`target_lang`): its `>>code<<` token opens each source.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from uptrain import UptrainError
from uptrain.architecture import Architecture, TargetPrompt
from uptrain.objectives import Objective
from uptrain.strict_json import read_json

# `speech_task`, not `task`: `uptrain compare` embeds the run's keys and has a `task` of its own
# (the evaluation tasks it scores); this is Whisper's transcribe / translate.
SPEECH_KEYS = ("language", "speech_task")
LANGUAGE_KEYS = ("source_lang", "target_lang")
KEYS_OF = {
    TargetPrompt.SPEECH_TASK: SPEECH_KEYS,
    TargetPrompt.LANGUAGE_CODES: LANGUAGE_KEYS,
    TargetPrompt.TARGET_CODE_IN_SOURCE: ("target_lang",),
}
# What each key applies to, for the refusal of a key given where it does not.
APPLIES_TO = {
    "language": "Whisper checkpoints (speech_pairs)",
    "speech_task": "Whisper checkpoints (speech_pairs)",
    "source_lang": "objective pairs of mBART and M2M100/NLLB",
    "target_lang": "objective pairs of mBART, M2M100/NLLB and multilingual Marian",
}


@dataclass(frozen=True)
class PromptKeys:
    """A run's keys that choose the prompt (None: the checkpoint's own)."""

    language: str | None = None
    speech_task: str | None = None
    source_lang: str | None = None
    target_lang: str | None = None

    def given(self, names: tuple[str, ...] = SPEECH_KEYS + LANGUAGE_KEYS) -> list[str]:
        return [n for n in names if getattr(self, n) is not None]


@dataclass(frozen=True)
class TargetFraming:
    """What every example of a run carries besides its texts.

    `label_prefix`: label ids ahead of the transcript (Whisper's prompt after the decoder start);
    with it the transcript is tokenized without the tokenizer's own special tokens, the prefix and
    EOS framing it instead. `source_prefix`: text written ahead of each source (Marian's `>>fra<<`).
    `shown`: the prompt as the plan prints it. `generation`: the generation-config settings that make
    `generate()` start with the same prompt (`uptrain evaluate`): Whisper's `language` and `task`,
    the target code as `forced_bos_token_id` (or, where the tokenizer closes targets with it, as
    mBART-cc25 does, as the decoder start its shift wraps round)."""

    shown: str
    label_prefix: tuple[int, ...] | None = None
    text_prefix: str = ""
    source_prefix: str = ""
    generation: tuple[tuple[str, object], ...] = ()


def target_framing(
    arch: Architecture | None, objective: Objective, keys: PromptKeys, tokenizer, model_path: str, model_config: dict
) -> TargetFraming | None:
    """The prompt of the run's targets for `objective` on the checkpoint at `model_path`; None where
    the tokenizer's targets are used as they are. Refuses, in one line, a key the family or the
    objective does not take, and a checkpoint that needs a key it was not given. May set the
    tokenizer's `src_lang` / `tgt_lang` (mBART, NLLB): the run's tokenizer writes them from then on."""
    rule = arch.target_prompt if arch is not None else None
    name = arch.name if arch is not None else model_config.get("model_type", "?")
    takes = KEYS_OF.get(rule, ()) if objective.reads_examples else ()
    if stray := [k for k in keys.given() if k not in takes]:
        raise UptrainError(
            f"`{stray[0]}` applies to {APPLIES_TO[stray[0]]}; {model_path} is {name}, trained on objective "
            f"{objective.name}"
        )
    if rule is None or not objective.reads_examples:
        return None
    if rule is TargetPrompt.SPEECH_TASK:
        return _speech_task(keys, tokenizer, model_path, model_config)
    if rule is TargetPrompt.LANGUAGE_CODES:
        return _language_codes(keys, tokenizer, model_path)
    return _target_code_in_source(keys, tokenizer, model_path)


def _generation_config(model_path: str) -> dict:
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return {}
    found = read_json(path, unique_keys=False)
    if not isinstance(found, dict):
        raise UptrainError(f"{path} holds a JSON {type(found).__name__}, not a generation config")
    return found


def _language_token(language: str, lang_to_id: dict, model_path: str) -> str:
    """`en`, `english` or `<|en|>` → `<|en|>`, as `generate(language=…)` reads it."""
    from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

    word = language.strip().lower()
    token = word if word.startswith("<|") else f"<|{TO_LANGUAGE_CODE.get(word, word)}|>"
    if token not in lang_to_id:
        codes = ", ".join(sorted(t.strip("<|>") for t in lang_to_id)[:12])
        raise UptrainError(
            f"`language` {language!r} is not a language of {model_path} (generation_config.json lang_to_id: {codes}, …)"
        )
    return token


def _speech_task(keys: PromptKeys, tokenizer, model_path: str, model_config: dict) -> TargetFraming:
    gen = _generation_config(model_path)
    lang_to_id, task_to_id = (m if isinstance(m := gen.get(k), dict) else {} for k in ("lang_to_id", "task_to_id"))
    multilingual = gen["is_multilingual"] if gen.get("is_multilingual") is not None else bool(lang_to_id)
    # forced_decoder_ids: [[1, lang], [2, task], [3, notimestamps]], positions after the decoder start.
    raw = gen.get("forced_decoder_ids") or model_config.get("forced_decoder_ids") or []
    forced = dict(f for f in raw if isinstance(f, list) and len(f) == 2) if isinstance(raw, list) else {}
    prefix: list[int] = []
    generation: tuple = ()  # English-only: generate() forces <|notimestamps|> and takes no language or task
    if not multilingual:
        if given := keys.given(SPEECH_KEYS):
            raise UptrainError(
                f"{model_path} is an English-only Whisper (its generation config is not multilingual): "
                f"it takes no `{given[0]}`"
            )
    else:
        if not lang_to_id or not task_to_id:
            raise UptrainError(
                f"{model_path} is a multilingual Whisper whose generation_config.json has no lang_to_id / task_to_id: "
                "its language and task tokens are unknown"
            )
        # A fine-tuned checkpoint names its language in the generation config (transformers'
        # recipe) or in its tokenizer's prefix (WhisperTokenizer(language=…)).
        language = keys.language or gen.get("language") or getattr(tokenizer, "language", None)
        if language is not None:
            lang_id = lang_to_id[_language_token(language, lang_to_id, model_path)]
        elif forced.get(1) in lang_to_id.values():
            lang_id = forced[1]
        else:
            raise UptrainError(
                f"{model_path} is a multilingual Whisper and its generation config names no language: set `language` "
                "(the audio's, e.g. en), whose token opens every target as `generate(language=…)` forces it"
            )
        task = keys.speech_task or gen.get("task") or getattr(tokenizer, "task", None)
        if task is None:
            by_id = {i: t for t, i in task_to_id.items()}
            task = by_id.get(forced.get(2), "transcribe")
        if task not in task_to_id:
            raise UptrainError(f"`speech_task` {task!r} is not a task of {model_path} ({', '.join(task_to_id)})")
        prefix += [lang_id, task_to_id[task]]
        token = next(t for t, i in lang_to_id.items() if i == lang_id)
        generation = (("language", token), ("task", task))
    if gen.get("no_timestamps_token_id") is not None:
        prefix.append(gen["no_timestamps_token_id"])
    start = model_config["decoder_start_token_id"]
    shown = "".join(str(t) for t in tokenizer.convert_ids_to_tokens([start, *prefix]))
    # Whisper writes a transcript as " text" after its prompt tokens (OpenAI's tokenizer encodes
    # " " + text.strip(); greedy decoding emits "ĠThe", not "The"): without the space every target's
    # first word is tokenized unlike what the model generates, and perplexity is measured on it.
    return TargetFraming(shown, label_prefix=tuple(prefix), text_prefix=" ", generation=generation)


def _lang_token(tokenizer, code: str) -> str:
    # M2M100's tokenizer names its codes `en` and writes them as `__en__`; mBART's and NLLB's are tokens.
    return tokenizer.get_lang_token(code) if hasattr(tokenizer, "get_lang_token") else code


def _language_codes(keys: PromptKeys, tokenizer, model_path: str) -> TargetFraming | None:
    if not hasattr(tokenizer, "tgt_lang"):
        if given := keys.given(LANGUAGE_KEYS):
            raise UptrainError(
                f"`{given[0]}` sets the tokenizer's language codes, and the tokenizer of {model_path} "
                f"({type(tokenizer).__name__}) has none (no src_lang / tgt_lang)"
            )
        return None  # a tokenizer without language codes (one language pair): its targets as they are
    vocab = tokenizer.get_vocab()
    for key, attribute in zip(LANGUAGE_KEYS, ("src_lang", "tgt_lang")):
        code = getattr(keys, key)
        if code is None:
            continue
        if _lang_token(tokenizer, code) not in vocab:
            raise UptrainError(f"`{key}` {code!r} is not a language code of the tokenizer of {model_path}")
        setattr(tokenizer, attribute, code)  # mBART's and NLLB's setters rewrite their special tokens
    if tokenizer.tgt_lang is None:
        raise UptrainError(
            f"the tokenizer of {model_path} names no target language (tgt_lang): set `target_lang`, the code "
            "each target starts with as `generate(forced_bos_token_id=…)` forces it"
        )
    code_id = tokenizer.convert_tokens_to_ids(_lang_token(tokenizer, tokenizer.tgt_lang))
    target_ids = tokenizer(text_target="x")["input_ids"]
    if code_id not in target_ids:
        raise UptrainError(
            f"the tokenizer of {model_path} ({type(tokenizer).__name__}) does not write its target language code "
            f"{tokenizer.tgt_lang} into targets"
        )
    # Labels [code, …, </s>] are scored after the decoder start, the code then forced first; labels
    # [… </s>, code] (mBART-cc25) are shifted with the code wrapped round to be the decoder start.
    forced = "decoder_start_token_id" if target_ids[-1] == code_id else "forced_bos_token_id"
    source = getattr(tokenizer, "src_lang", None)
    shown = f"{source} → {tokenizer.tgt_lang}" if source else f"→ {tokenizer.tgt_lang}"
    return TargetFraming(shown, generation=((forced, code_id),))


def _target_code_in_source(keys: PromptKeys, tokenizer, model_path: str) -> TargetFraming | None:
    if keys.target_lang is None:
        return None  # a one-pair Marian, or sources that carry their codes already
    token = f">>{keys.target_lang}<<"
    if token not in tokenizer.get_vocab():
        raise UptrainError(
            f"`target_lang` {keys.target_lang!r}: the tokenizer of {model_path} has no {token} token "
            "(a multilingual Marian names its targets' languages so)"
        )
    return TargetFraming(f"{token} ahead of each source", source_prefix=token + " ")


def framed_target_ids(tokenizer, texts: list[str], target_len: int, framing: TargetFraming) -> list[list[int]]:
    """Label ids `label_prefix` + the tokens of `text_prefix` + the text (its own leading blanks
    dropped: Whisper's " text" has one space), without the tokenizer's special tokens, which the
    prefix replaces, + EOS, the text cut so that each holds at most `target_len`. The one framing of
    a prompted family's targets: training, calibration and evaluation all read targets through it.
    Refuses, in one line, a `target_len` that leaves no room for any text."""
    prefix = list(framing.label_prefix or ())
    room = target_len - len(prefix) - 1
    if room < 1:
        raise UptrainError(
            f"target_len {target_len} leaves no room for text after the prompt {framing.shown} and EOS "
            f"({len(prefix) + 1} label tokens); set a larger `target_len`"
        )
    if framing.text_prefix:
        texts = [framing.text_prefix + text.lstrip() for text in texts]
    texts_ids = tokenizer(text_target=texts, add_special_tokens=False, truncation=True, max_length=room)["input_ids"]
    return [prefix + ids[:room] + [tokenizer.eos_token_id] for ids in texts_ids]
