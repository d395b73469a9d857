"""Train the shipped byte-level BPE tokenizer on the corpus's train split.

    python scripts/train_tokenizer.py          # writes uptrain/assets/tokenizer/

Byte-level (GPT-2 style): every byte has a token, so there is no unknown token and any text
round-trips exactly. Only the train split is read, so validation/test stay unseen. Training is
deterministic (same input order, ties broken by pair id in `tokenizers`): rerunning gives a
byte-identical tokenizer.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from uptrain.data.corpus import EOS_TOKEN, PAD_TOKEN, TOKENIZER_DIR, read_documents

VOCAB_SIZE = 8192


def train(vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    texts = [d["text"] for d in read_documents("train")]
    tok = Tokenizer(models.BPE())
    # No prefix space: documents start at a line start, and a decoded sequence must equal
    # the input exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        # EOS is id 0. PAD exists so collators that need padding do not reuse EOS (which
        # would mask the EOS labels); packed pretraining never uses it.
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,  # decode must give back the text unchanged
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    ap.add_argument("--out-dir", type=Path, default=TOKENIZER_DIR)
    args = ap.parse_args(argv)
    tokenizer = train(args.vocab_size)
    tokenizer.save_pretrained(str(args.out_dir))
    for path in sorted(args.out_dir.iterdir()):
        print(f"{path.name:28s} {path.stat().st_size:>9,d} bytes")
    for split in ("train", "validation", "test"):
        n = sum(len(tokenizer(d["text"], add_special_tokens=False)["input_ids"]) + 1 for d in read_documents(split))
        print(f"{split:10s} {n:>10,d} tokens (EOS after each document)")


if __name__ == "__main__":
    main()
