"""What `uptrain tokenize` is: its options, validated once (YAML keys, flags and `--help` from the
one option engine, `uptrain.options`), as `convert/spec.py` and `compare/spec.py` hold theirs. The
engine that writes OUT is `uptrain.data.tokenize`; `uptrain.cli` runs one with the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from uptrain.options import Schema, option

DEFAULT_SHARD_TOKENS = 2**27  # 256 MiB of uint16 ids per shard


@dataclass(kw_only=True)
class TokenizeOptions(Schema):
    """`uptrain tokenize`: what to tokenize, with which tokenizer, into which blocks, where."""

    data: str | list[str] = option(
        positional=True,
        metavar="DATA",
        help="text: .txt/.jsonl/.json/.parquet file(s) (also compressed), globs or a folder of them",
    )
    out: str = option(
        positional=True,
        metavar="OUT",
        help="output folder of token shards; built in a hidden sibling and renamed when complete",
    )
    tokenizer: str = option(metavar="MODEL", help="model folder or Hub id whose tokenizer to use: the model to train")
    seq_len: int = option(at_least=2, help="tokens per block: the seq_len of the runs that will read OUT")
    text_field: str = option("text", help="column holding the text in jsonl/json/parquet files")
    sample_by: Literal["line", "paragraph", "document"] = option(
        "paragraph", help="what one document is in a .txt file; documents are joined with EOS"
    )
    shard_tokens: int = option(
        DEFAULT_SHARD_TOKENS, at_least=1, help="tokens per shard file, rounded down to whole blocks (at least one)"
    )
    overwrite: bool = option(
        False, help="replace OUT if it exists, and discard what an interrupted run with other settings left"
    )
