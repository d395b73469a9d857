"""Greedy generation with the KV cache over a task's examples, as a user decodes: transformers'
`generate` (`do_sample=False, num_beams=1, use_cache=True`), so that a model's own generation
settings (Whisper's prompt, a forced first token) apply as they do for its users, and the family's
prompt the targets were read with (`--language`, `--target-lang`, …: train's `TargetFraming`) is
forced as users force it (`generate(language=…, task=…)`, `forced_bos_token_id`). Every example
gets exactly one prediction, in order: Whisper's clips are decoded once each (one call of its
generate, not its long-form loop over timestamp tokens).

An encoder–decoder reads the source (token ids, or a speech encoder's input features) and its
decoder generates the prediction from its start token. A decoder-only model continues the source
text: the prediction is what it generates after it. Sources of a batch are left-padded, so every
continuation starts right after its own source. Each batch is timed (the prompt's pass and every
decode step, synchronised on a GPU), for the time per sample the paper reports beside the scores.
"""

from __future__ import annotations

import copy
import inspect
import time

from uptrain import UptrainError
from uptrain.speed import synchronize


def _decoder_only_batch(sources: list[list[int]], pad_id: int, device) -> dict:
    import torch

    width = max(map(len, sources))
    input_ids = torch.tensor([[pad_id] * (width - len(s)) + s for s in sources], device=device)
    attention_mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sources], device=device)
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def _encoder_decoder_batch(examples, indices: list[int], model, device) -> dict:
    batch = examples.take(indices)
    batch.pop("labels")
    return {
        name: t.to(device=device, dtype=model.dtype) if t.is_floating_point() else t.to(device)
        for name, t in batch.items()
    }


def generation_settings(model, tokenizer, max_new_tokens: int, framing=None):
    """The model's own generation config with greedy decoding set, on a copy (passed whole:
    transformers warns when a config and loose generation arguments are mixed), and the family's
    prompt forced as training framed the targets (`framing`, a `TargetFraming` of
    `uptrain.objectives.prompts`: Whisper's language and task, mBART's / NLLB's target code)."""
    eos = model.generation_config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    settings = copy.deepcopy(model.generation_config)
    settings.update(
        do_sample=False,
        num_beams=1,
        use_cache=True,
        max_new_tokens=max_new_tokens,
        max_length=None,  # max_new_tokens alone bounds the generation
        eos_token_id=eos,
        pad_token_id=pad,
    )
    # Whisper's generate (the one with `force_unique_generate_call`) runs its long-form loop even on
    # one 30 s window: it takes every token after <|notimestamps|> for a timestamp and, when a decode
    # holds two in a row, seeks on within the window and decodes again, joining the decodes into one
    # prediction (a converted model that emits timestamp tokens gets several transcripts joined; with
    # return_dict_in_generate a pass's finished clips leave the batch, and fewer sequences than
    # clips come back). One call of generate per batch: each clip decoded once, as training framed it.
    if "force_unique_generate_call" in inspect.signature(model.generate).parameters:
        settings.force_unique_generate_call = True
    # Set, not `update`d: update skips what the config has no attribute for (Whisper's `language`
    # and `task` where the checkpoint's config names none), and generate() would then detect a language.
    for name, value in framing.generation if framing is not None else ():
        setattr(settings, name, value)
    return settings


def generate_predictions(
    model, tokenizer, examples, *, batch_size: int, max_new_tokens: int, device, framing=None
) -> tuple:
    """(the decoded prediction of every example in order, the seconds generation took in all).
    `examples` is a `PairExamples` (uptrain.data.pairs), read with `framing`, whose prompt every
    generation starts with (`generation_settings`); predictions are decoded without special tokens
    and stripped."""
    import torch

    seq2seq = model.config.is_encoder_decoder
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    settings = generation_settings(model, tokenizer, max_new_tokens, framing)
    predictions: list[str] = []
    seconds = 0.0
    with torch.inference_mode():
        for start in range(0, len(examples), batch_size):
            indices = list(range(start, min(start + batch_size, len(examples))))
            if seq2seq:
                inputs = _encoder_decoder_batch(examples, indices, model, device)
            else:
                inputs = _decoder_only_batch([examples.sources[i] for i in indices], pad, device)
            synchronize(device)
            began = time.perf_counter()
            output = model.generate(**inputs, generation_config=settings)
            synchronize(device)
            seconds += time.perf_counter() - began
            if output.shape[0] != len(indices):  # one transcript per example, or the scores pair them wrongly
                raise UptrainError(
                    f"generate returned {output.shape[0]} sequences for a batch of {len(indices)} examples "
                    f"(examples {indices[0]}–{indices[-1]})"
                )
            new = output if seq2seq else output[:, inputs["input_ids"].shape[1] :]
            predictions += [text.strip() for text in tokenizer.batch_decode(new, skip_special_tokens=True)]
    return predictions, seconds
