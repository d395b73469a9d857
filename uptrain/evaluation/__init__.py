"""Task metrics (`uptrain evaluate`; `uptrain compare --task`): a checkpoint's scores on the
tasks the paper's Table 1 reports, with the field's own metric libraries (the `uptrain[eval]`
extra) and every prediction kept.

- `tasks.py`: the registry of generation tasks (asr, translation, summarization, qa): what a line
  of their data holds, the metrics, the library, the score a comparison shows;
- `scores.py`: the metrics (jiwer, sacrebleu, rouge-score; SQuAD's exact match and F1 written here);
- `generation.py`: greedy generation with the KV cache over the examples, timed;
- `harness.py`: lm-evaluation-harness tasks on the model in memory;
- `run.py`: `evaluate_model`, its options (`EvaluateOptions`) and its output.
"""
