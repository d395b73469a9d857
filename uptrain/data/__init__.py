"""The data: text → token blocks and the batches a run trains and evaluates on.

Shared by training and calibration (a conversion step), so it sits below both. `blocks` is the
one protocol every indexed source meets (`len` and `take(indices)`); `text` reads local files or
a Hub dataset, tokenized and packed into `seq_len` blocks (or streamed); `shards` is the folder
`uptrain tokenize` writes, memory-mapped, `spec` that command's options and `tokenize` its
engine; `corpus` the shipped corpus and tokenizer (package data in `uptrain/assets/`);
`batches` the order of training blocks, streamed shares and evaluation batches;
`objective_batches` a run's objective and the model inputs it makes of blocks; `pairs` aligned
text and speech examples; `document_mask` packed documents kept apart.
"""
