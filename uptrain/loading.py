"""The one tokenizer loader and the one model loader: a checkpoint folder as transformers loads
it, or one line saying why it cannot be (`{what} {path} …`, what = "model", "teacher", …).

Imports nothing of uptrain's but the error type, so that every layer may load a tokenizer. The
GQA architectures uptrain writes (`gpt2_gqa`, …) load once `uptrain.modeling` is imported: the
callers that may meet one import it first (it registers them with the Auto classes; this module
cannot, being below it).

Never trusts a folder's own code (`trust_remote_code=False`, passed to every transformers
loader): a converted folder names its modeling files in `auto_map`, and transformers asks on the
terminal ("Do you wish to run the custom code? [y/N]") whenever trust is not given either way —
a prompt on stdout that breaks `--json` and waits for a person. Unregistered, such a folder is
one line instead; its tokenizer needs no model code and loads either way.
"""

from __future__ import annotations

from pathlib import Path

from uptrain import UptrainError, exception_line


def load_tokenizer(path: str | Path, what: str):
    """The tokenizer of the model folder or Hub id `path`, with the EOS token that joins documents."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as err:  # transformers raises many types; the user needs the one line
        raise UptrainError(f"{what} {path} has no usable tokenizer: {exception_line(err)}") from None
    if tokenizer.eos_token_id is None:
        raise UptrainError(f"{what} {path} has a tokenizer without an EOS token to join documents with")
    return tokenizer


def load_model(
    path: str | Path,
    what: str,
    auto_class: str = "AutoModelForCausalLM",
    dtype=None,
    device_map: str | None = None,
    weights: bool = True,
):
    """The model in `path` as transformers' `auto_class` builds it, in `dtype` (torch.float32 when
    None), on `device_map` (the CPU when None). `weights=False`: every parameter on the meta device
    instead (buffers real), for a caller that fills the weights itself."""
    import torch
    import transformers

    auto = getattr(transformers, auto_class)
    dtype = torch.float32 if dtype is None else dtype
    try:
        if not weights:
            from accelerate import init_empty_weights

            config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=False)
            with init_empty_weights():
                return auto.from_config(config, dtype=dtype)
        placed = {} if device_map is None else {"device_map": device_map}
        return auto.from_pretrained(path, dtype=dtype, trust_remote_code=False, **placed)
    except Exception as err:  # a missing or damaged file, an unknown model_type: one line for the user
        raise UptrainError(f"cannot load {what} {path} with {auto_class}: {exception_line(err)}") from None
