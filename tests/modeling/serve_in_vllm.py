"""What tests/modeling/test_vllm.py asks of vLLM.

Run as a script (`python serve_in_vllm.py SPEC.json`) in the cached vLLM environment
(tests/modeling/vllm_environment.py): one process, one vLLM engine after another, each on one
checkpoint (float32, greedy), so that vLLM's import (slow) is paid once. For each checkpoint it
prints what the engine served: the greedy tokens of each prompt, the KV cache capacity (tokens)
vLLM reports, the model class it used, and how long the engine took to start, or the one line its failure gave. The
last line of stdout is the JSON of every case. Imports only vLLM (and what it imports).

SPEC = {"cases": {name: folder}, "prompts": [[…]], "new_tokens": n, "max_model_len": n}.
"""

from __future__ import annotations

import gc
import json
import sys
import time


def serve(folder: str, spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    started = time.monotonic()
    try:
        llm = LLM(
            model=folder,
            trust_remote_code=True,
            dtype="float32",
            skip_tokenizer_init=True,
            enforce_eager=True,  # no torch.compile: minutes per engine on CPU, and the same arithmetic
            max_model_len=spec["max_model_len"],
            max_num_seqs=len(spec["prompts"]),
            seed=0,
        )
    except Exception as error:  # noqa: BLE001  the refusal is the result: its last line is compared
        cleanup_dist_env_and_memory()
        lines = [line for line in str(error).strip().splitlines() if line.strip()]
        return {"error": f"{type(error).__name__}: {lines[-1] if lines else ''}"}
    start_seconds = time.monotonic() - started
    cache = llm.llm_engine.vllm_config.cache_config
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    greedy = SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"], ignore_eos=True, detokenize=False)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    result = {
        "tokens": [list(out.outputs[0].token_ids) for out in outputs],
        "kv_tokens": cache.num_gpu_blocks * cache.block_size,
        "architecture": llm.llm_engine.vllm_config.model_config.architecture,  # the class vLLM used
        "start_seconds": round(start_seconds, 1),
    }
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    return result


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    started = time.monotonic()
    import vllm

    results = {"vllm": vllm.__version__, "import_seconds": round(time.monotonic() - started, 1), "cases": {}}
    for name, folder in spec["cases"].items():
        results["cases"][name] = serve(folder, spec)
        print(name, results["cases"][name], file=sys.stderr, flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
