"""What tests/modeling/test_transformers_versions.py compares across transformers versions.

Run as a script (`python -I load_without_uptrain.py SPEC.json`) in a process without uptrain,
under whichever transformers that process has (the 4.57 venv the test builds): it loads each
converted checkpoint with `trust_remote_code=True`, from the files beside its weights, on each
attention backend and prints `results(...)` as JSON. The test calls `results` in-process
too, with uptrain's registered classes under the installed transformers 5. Imports only
torch and transformers.

SPEC = {"folders": {name: path}, "ids": [[…]], "mask": [[…]], "backends": [...],
"new_tokens": n, "native": bool}: with `native` (an MLA conversion, DeepSeek-V2) the checkpoints
are loaded as transformers' own classes, without remote code. Floats are written with
`float.hex`: the comparison is bit for bit (MLA's within float32 rounding).
"""

from __future__ import annotations

import json
import sys

import torch


def hexes(tensor: torch.Tensor) -> list[str]:
    return [float(x).hex() for x in tensor.double().flatten().tolist()]


def results(spec: dict, load) -> dict:
    """For each folder and backend (`load(folder, backend)` gives the model): logits of `ids`,
    logits of the positions a left-padded batch really has, greedy `generate()` with the KV
    cache, from the padded batch, and the shape of each layer's cache after `ids`."""
    ids, mask = torch.tensor(spec["ids"]), torch.tensor(spec["mask"])
    out = {}
    for name, folder in spec["folders"].items():
        for backend in spec["backends"]:
            model = load(folder, backend).eval()
            assert model.config._attn_implementation == backend, (name, model.config._attn_implementation)
            with torch.no_grad():
                forward = model(ids, use_cache=True)
                logits = forward.logits
                padded = model(ids, attention_mask=mask).logits[mask.bool()]
                generated = model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=spec["new_tokens"],
                    do_sample=False,
                    use_cache=True,
                    pad_token_id=0,
                    eos_token_id=None,
                )
            out[f"{name}/{backend}"] = {
                "logits": hexes(logits),
                "padded": hexes(padded),
                "generated": generated.tolist(),
                # [batch, KV heads, positions, head_dim] of each layer's cache: the heads it holds.
                "cache": [list(layer.keys.shape) for layer in forward.past_key_values.layers],
            }
    return out


def load_remote_code(folder: str, backend: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, attn_implementation=backend)
    assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    return model


def load_native(folder: str, backend: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=backend)
    assert type(model).__module__.startswith("transformers.models."), type(model).__module__
    return model


if __name__ == "__main__":
    import transformers

    spec = json.loads(open(sys.argv[1]).read())
    found = results(spec, load_native if spec.get("native") else load_remote_code)
    assert not [m for m in sys.modules if m.split(".")[0] == "uptrain"], "uptrain was imported"
    print(json.dumps({"transformers": transformers.__version__, "results": found}))
