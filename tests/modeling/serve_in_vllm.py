"""What tests/modeling/test_vllm.py and test_vllm_mla.py ask of vLLM.

Run as a script (`python serve_in_vllm.py SPEC.json`) in the cached vLLM environment
(tests/modeling/vllm_environment.py): one process, one vLLM engine after another, each on one
checkpoint (float32 unless the spec names a dtype; greedy), so that vLLM's import (slow) is paid
once. For each checkpoint it prints what the engine served: the greedy tokens of each prompt, the
KV cache capacity (tokens) vLLM reports (and its block size), the model class it used, and how long
the engine took to start, or the one line its failure gave. The last line of stdout is the JSON of
every case. Imports only vLLM (and what it imports).

SPEC = {"cases": {name: folder}, "prompts": [[…]], "new_tokens": n, "max_model_len": n,
"dtype": "bfloat16" (optional: vLLM's CPU MLA takes no float32), "case_prompts": {name: [[…]]}
(optional: a case's own prompts), "speech_cases": {name: folder},
"speech": {"waveforms": file.npy, "sampling_rate": n, "decoder_prompts": [[…]]}}: a speech case
(Whisper) is served each waveform of the .npy file (one a row) with its decoder prompt, through
vLLM's audio processing, with the checkpoint's tokenizer (vLLM's Whisper processor needs one). A
case also reports the KV heads of each attention layer vLLM cached (`kv_heads`: layer name →
heads, cross-attention's too).
"""

from __future__ import annotations

import gc
import json
import sys
import time


def text_prompts(spec: dict, name: str) -> list:
    from vllm.inputs import TokensPrompt

    prompts = spec.get("case_prompts", {}).get(name, spec["prompts"])
    return [TokensPrompt(prompt_token_ids=ids) for ids in prompts]


def speech_prompts(spec: dict) -> list:
    """Each waveform as the encoder's audio, its decoder prompt as given (token ids)."""
    import numpy as np
    from vllm.inputs import TokensPrompt

    speech = spec["speech"]
    waveforms = np.load(speech["waveforms"])
    rate = speech["sampling_rate"]
    return [
        {
            # The encoder's prompt is a placeholder its processor replaces by the audio's frames.
            "encoder_prompt": TokensPrompt(prompt_token_ids=[0], multi_modal_data={"audio": (wave, rate)}),
            "decoder_prompt": TokensPrompt(prompt_token_ids=ids),
        }
        for wave, ids in zip(waveforms, speech["decoder_prompts"])
    ]


def cached_kv_heads(llm) -> dict[str, int]:
    """Layer name → the KV heads of each attention layer that has a cache (vLLM's own record of
    the layers it built; the engine runs in this process)."""
    layers = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    return {name: layer.num_kv_heads for name, layer in layers.items() if hasattr(layer, "num_kv_heads")}


def serve(name: str, folder: str, spec: dict, speech: bool = False) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    prompts = speech_prompts(spec) if speech else text_prompts(spec, name)
    started = time.monotonic()
    try:
        llm = LLM(
            model=folder,
            trust_remote_code=True,
            dtype=spec.get("dtype", "float32"),
            skip_tokenizer_init=not speech,  # vLLM's Whisper processor needs the tokenizer
            enforce_eager=True,  # no torch.compile: minutes per engine on CPU, and the same arithmetic
            max_model_len=spec["max_model_len"],
            max_num_seqs=len(prompts),
            # A whole audio's encoder frames (1500) in one step: vLLM does not chunk them.
            max_num_batched_tokens=2048 if speech else None,
            seed=0,
        )
    except Exception as error:  # noqa: BLE001  the refusal is the result: its last line is compared
        cleanup_dist_env_and_memory()
        lines = [line for line in str(error).strip().splitlines() if line.strip()]
        return {"error": f"{type(error).__name__}: {lines[-1] if lines else ''}"}
    start_seconds = time.monotonic() - started
    cache = llm.llm_engine.vllm_config.cache_config
    greedy = SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"], ignore_eos=True, detokenize=False)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    result = {
        "tokens": [list(out.outputs[0].token_ids) for out in outputs],
        "kv_tokens": cache.num_gpu_blocks * cache.block_size,
        "block_size": cache.block_size,  # the KV cache is allocated in whole blocks of this many tokens
        "architecture": llm.llm_engine.vllm_config.model_config.architecture,  # the class vLLM used
        "kv_heads": cached_kv_heads(llm),
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
    cases = [(name, folder, False) for name, folder in spec["cases"].items()]
    cases += [(name, folder, True) for name, folder in spec.get("speech_cases", {}).items()]
    for name, folder, speech in cases:
        results["cases"][name] = serve(name, folder, spec, speech)
        print(name, results["cases"][name], file=sys.stderr, flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
