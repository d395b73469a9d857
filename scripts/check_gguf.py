"""The GGUF path for the Llama family, checked in llama.cpp: uptrain's outputs through llama.cpp's
own converter (`convert_hf_to_gguf.py`) and its own runtime, against transformers.

    python scripts/check_gguf.py [--cache ~/.cache/uptrain-gguf] [--version 0.3.36]
        [--prompts 4] [--new-tokens 24] [--threads 2]      # not in CI: compiles llama.cpp once

llama.cpp comes from PyPI only: the `llama-cpp-python` sdist (`pip download --no-binary`) vendors
llama.cpp with its converter and gguf-py. Everything lives in the cache, outside the repo: the
sdist, a `--target` folder with what the converter and the bindings import beyond this venv
(sentencepiece, diskcache), llama.cpp's shared library built with cmake (target `llama` only:
minutes on 2 cores; the sdist's full `pip install` builds far more), the models and their GGUFs.
A missing tool (cmake, a C++ compiler) is refused in one line.

Models, all from the shipped reference Llama (8 heads of 32, 6 layers, MLP 704):
- `g2`: `uptrain convert REF -g 2`, the plain Llama layout (one `num_key_value_heads`);
- `per-layer`: `--kv-heads-per-layer 4,1,1,2,2,2` (the same 12 KV heads of 48 as G = 2), the
  DeciLM layout. Its MLP width (704) is no multiple of 256, so its blocks state
  `ffn.intermediate_size`, which the converter's `block_configs` path does not read: converted
  through the converter's other DeciLM path (DeciLM-7B's: `num_key_value_heads_per_layer`,
  `intermediate_size`), by a copy of `config.json` without `block_configs`;
- `per-layer-512`: the same allocation on the reference cut to an MLP of 512 columns (a multiple
  of 256, as every published Llama's; `ffn_mult` 3.0), converted as written, through
  `block_configs`.
Each GGUF (f32) loads in llama.cpp, which reports each layer's KV heads (against the
conversion's); on `--prompts` passages of the shipped corpus' test split its greedy tokens
(`--new-tokens`, no stop) are compared with transformers' on the same checkpoint in float32, fed
the same prompt ids, with the largest logit difference on the way, with llama.cpp's flash
attention off (float32 throughout) and on (its default); its tokenizer is compared with
transformers' on the same passages; its float32 K and V cache at 8,192 positions (1 MiB a head of
32 dims) against positions · head_dim · 4 B · Σ_l KV heads_l each, except V without flash
attention, which llama.cpp pads in every layer to the largest layer's heads. One line per model.

Two registrations the converter needs for the reference's tokenizer, made in the converter's
process (`--convert` below), neither a change to the checkpoint:
- the converter names a BPE pre-tokenizer by a hash of its output on a fixed text, which a
  tokenizer trained for this project cannot be among; a tokenizer.json whose only pre-tokenizer is
  ByteLevel with its regex (GPT-2's) is named "gpt-2" (checked: the token comparison);
- its DeciLM path reads a vocabulary only as Llama 3's (128,256 tokens) or Llama 2's byte-fallback
  BPE; any other falls back to the Llama class's own reader (the GPT-2 BPE one).
"""

from __future__ import annotations

import argparse
import ctypes
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REFERENCE = REPO / "uptrain" / "assets" / "reference"
TEST_SPLIT = REPO / "uptrain" / "assets" / "corpus" / "test.jsonl.gz"
PER_LAYER = (4, 1, 1, 2, 2, 2)
NARROW_MLP = 512  # a multiple of 256: block_configs' ffn_mult reaches it
GGML_TYPE_F32 = 0
FLASH_ATTENTION_DISABLED, FLASH_ATTENTION_ENABLED = 0, 1  # llama.cpp's enum llama_flash_attn_type
CACHE_CELLS = 8192  # · 32 dims · 4 B = 1 MiB a KV head of a layer, for K and for V


class Refusal(Exception):
    """What stops the check, said in one line."""


def run(cmd: list[str], log: Path | None = None, env: dict | None = None) -> None:
    """`cmd`, its output into `log` (or shown on failure), niced: the cores are shared."""
    with open(log or os.devnull, "w") as out:
        done = subprocess.run(["nice", "-n", "10", *cmd], stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        tail = log.read_text().strip().splitlines()[-1] if log else ""
        raise Refusal(f"{Path(cmd[0]).name} {' '.join(cmd[1:3])} … failed (exit {done.returncode}): {tail}")


def require_tools() -> None:
    missing = [tool for tool in ("cmake", "c++", "nice") if shutil.which(tool) is None]
    if missing:
        raise Refusal(f"{', '.join(missing)} not found: building llama.cpp needs cmake and a C++ compiler")


def fetch_llama_cpp(cache: Path, version: str) -> Path:
    """The sdist's vendored llama.cpp, downloaded from PyPI with pip and unpacked once."""
    root = cache / f"llama_cpp_python-{version}"
    if not (root / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").is_file():
        cache.mkdir(parents=True, exist_ok=True)
        sdist = cache / f"llama_cpp_python-{version}.tar.gz"
        if not sdist.is_file():
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python"]
            run([*pip, f"llama-cpp-python=={version}", "-d", str(cache)], cache / "pip-download.log")
        unpacked = cache / f".unpack-{os.getpid()}"  # renamed in whole: a killed unpack leaves no half tree
        shutil.rmtree(unpacked, ignore_errors=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(unpacked, filter="data")
        shutil.rmtree(root, ignore_errors=True)
        (unpacked / root.name).rename(root)
        shutil.rmtree(unpacked)
    return root


def ensure_site(cache: Path) -> Path:
    """What the converter (sentencepiece) and the bindings (diskcache) import beyond this venv."""
    site = cache / "site"
    if not (site / "sentencepiece").is_dir() or not (site / "diskcache").is_dir():
        pip = [sys.executable, "-m", "pip", "install", "--target", str(site), "sentencepiece", "diskcache"]
        run(pip, cache / "pip-install.log")
    return site


def build_llama_cpp(cache: Path, root: Path, version: str) -> Path:
    """libllama.so (and ggml's) built from the vendored sources: the library target only."""
    build = cache / f"build-{version}"
    lib = build / "bin"
    if not (lib / "libllama.so").is_file():
        off = ["TESTS", "TOOLS", "EXAMPLES", "SERVER", "APP", "COMMON"]
        flags = [f"-DLLAMA_BUILD_{name}=OFF" for name in off] + ["-DLLAMA_OPENSSL=OFF", "-DGGML_OPENMP=OFF"]
        source = root / "vendor" / "llama.cpp"
        configure = ["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"]
        run([*configure, "-DBUILD_SHARED_LIBS=ON", *flags], cache / "cmake-configure.log")
        run(["cmake", "--build", str(build), "--target", "llama", "-j", str(os.cpu_count() or 1)], cache / "build.log")
    return lib


def corpus_prompts(count: int, chars: int = 300) -> list[str]:
    """`count` passages of the shipped test split: from the middle of each work, at a line start."""
    prompts = []
    with gzip.open(TEST_SPLIT, "rt", encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            start = text.index("\n", len(text) // 2) + 1
            prompts.append(text[start : start + chars].strip())
            if len(prompts) == count:
                break
    return prompts


def narrow_reference(out: Path) -> None:
    """The reference with its MLP cut to its first NARROW_MLP columns: a Llama whose width
    `block_configs`' `ffn_mult` reaches (the weights change; both engines read the same ones)."""
    from safetensors.torch import load_file, save_file

    state = load_file(REFERENCE / "model.safetensors")
    for name in list(state):
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            state[name] = state[name][:NARROW_MLP].contiguous()
        elif name.endswith("mlp.down_proj.weight"):
            state[name] = state[name][:, :NARROW_MLP].contiguous()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((REFERENCE / "config.json").read_text())
    (tmp / "config.json").write_text(json.dumps({**config, "intermediate_size": NARROW_MLP}, indent=2))
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REFERENCE / name, tmp / name)
    tmp.rename(out)


def converted_models(models: Path) -> dict[str, tuple[Path, Path, tuple[int, ...]]]:
    """name → (checkpoint transformers loads, folder the GGUF converter reads, KV heads a layer)."""
    uptrain = [sys.executable, "-m", "uptrain"]
    narrow = models / "reference-mlp512"
    if not narrow.is_dir():
        narrow_reference(narrow)
    plan = {
        "g2": (REFERENCE, ["-g", "2"], (2,) * 6),
        "per-layer": (REFERENCE, ["--kv-heads-per-layer", ",".join(map(str, PER_LAYER))], PER_LAYER),
        "per-layer-512": (narrow, ["--kv-heads-per-layer", ",".join(map(str, PER_LAYER))], PER_LAYER),
    }
    out = {}
    for name, (source, flags, heads) in plan.items():
        folder = models / name
        if not folder.is_dir():
            run([*uptrain, "convert", str(source), str(folder), *flags], models / f"{name}.convert.log")
        out[name] = (folder, gguf_source(folder), heads)
    return out


def gguf_source(folder: Path) -> Path:
    """The folder the converter reads: `folder` itself, or, where a block states its MLP as
    `ffn.intermediate_size` (no `ffn_mult` reaches the width), a view of it whose config.json has
    no `block_configs` (the converter's DeciLM-7B path: per-layer KV heads and one width)."""
    config = json.loads((folder / "config.json").read_text())
    if all("ffn_mult" in block["ffn"] for block in config.get("block_configs", [{"ffn": {"ffn_mult": 0}}])):
        return folder
    view = folder.with_name(folder.name + ".gguf-view")
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir()
    for item in folder.iterdir():
        if item.name != "config.json":
            (view / item.name).symlink_to(item)
    del config["block_configs"]
    (view / "config.json").write_text(json.dumps(config, indent=2))
    return view


def convert_to_gguf(source: Path, gguf: Path, llama_cpp: Path, site: Path) -> None:
    """`gguf` written by llama.cpp's converter (to a sibling, renamed when complete)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(llama_cpp)])}
    partial = gguf.with_name(gguf.name + ".partial")
    cmd = [sys.executable, __file__, "--convert", str(source), str(partial), "--llama-cpp", str(llama_cpp)]
    run(cmd, gguf.with_suffix(".convert.log"), env)
    partial.rename(gguf)


def pre_tokenizer_name(spec: dict) -> str | None:
    """llama.cpp's name for the pre-tokenizer of a tokenizer.json (`spec`) its converter does not
    know by hash: "gpt-2" where the text is split only by GPT-2's regex (ByteLevel with its regex,
    no normalizer), which llama.cpp's "gpt-2" applies; None for anything else."""
    pre = spec.get("pre_tokenizer") or {}
    if spec.get("normalizer") is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    return None


def converter_main(source: str, gguf: str, llama_cpp: str) -> None:
    """llama.cpp's converter with the two registrations the module docstring names, in this process."""
    sys.path.insert(0, llama_cpp)
    import convert_hf_to_gguf
    from conversion.base import TextModel
    from conversion.deci import DeciModel

    find_pre = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return find_pre(self, tokenizer)
        except NotImplementedError:
            name = pre_tokenizer_name(json.loads((Path(self.dir_model) / "tokenizer.json").read_text()))
            if name is None:
                raise
            return name

    read_deci_vocab = DeciModel.set_vocab

    def set_vocab(self) -> None:
        try:
            read_deci_vocab(self)
        except FileNotFoundError:  # LlamaHfVocab: "Cannot find Llama BPE tokenizer"
            self._set_vocab_gpt2()

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    DeciModel.set_vocab = set_vocab
    sys.argv = ["convert_hf_to_gguf.py", source, "--outtype", "f32", "--outfile", gguf]
    convert_hf_to_gguf.main()


class LlamaCpp:
    """One GGUF loaded in llama.cpp through llama-cpp-python's ctypes bindings, its log kept."""

    def __init__(self, gguf: Path, threads: int):
        from llama_cpp import llama_cpp as ll

        self.ll, self.threads, self.log = ll, threads, []
        # kept on self: llama.cpp calls it for as long as the library lives
        self.callback = ll.llama_log_callback(lambda level, text, data: self.log.append(text.decode(errors="replace")))
        ll.llama_log_set(self.callback, ctypes.c_void_p())
        ll.llama_backend_init()
        self.model = ll.llama_model_load_from_file(str(gguf).encode(), ll.llama_model_default_params())
        if not self.model:
            raise Refusal(f"llama.cpp did not load {gguf}: {''.join(self.log).strip().splitlines()[-1]}")
        log = "".join(self.log)
        self.layers = int(re.search(r"n_layer\s+=\s+(\d+)", log).group(1))
        heads = re.search(r"n_head_kv\s+=\s+(\[[^\]]*\]|\d+)", log).group(1)
        # llama.cpp's own reading of each layer's KV heads; one number where all layers have the same
        self.kv_heads = tuple(json.loads(heads)) if heads.startswith("[") else (int(heads),) * self.layers
        self.vocab = ll.llama_model_get_vocab(self.model)
        self.n_vocab = ll.llama_vocab_n_tokens(self.vocab)
        self.ctx = None

    def open(self, flash_attention: bool, cells: int = 0) -> tuple[int, int]:
        """A fresh context (float32 cache, `cells` positions; 0: the model's), and the bytes of
        its K and of its V cache as llama.cpp reports them (its log, in MiB to 2 decimals)."""
        ll = self.ll
        self.close_context()
        params = ll.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_threads, params.n_threads_batch = cells, 512, self.threads, self.threads
        params.type_k = params.type_v = GGML_TYPE_F32
        params.flash_attn_type = FLASH_ATTENTION_ENABLED if flash_attention else FLASH_ATTENTION_DISABLED
        self.log.clear()
        self.ctx = ll.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise Refusal(f"llama.cpp made no context: {''.join(self.log).strip().splitlines()[-1]}")
        size = re.search(r"K \(f32\):\s*([\d.]+) MiB, V \(f32\):\s*([\d.]+) MiB", "".join(self.log))
        return round(float(size.group(1)) * 2**20), round(float(size.group(2)) * 2**20)

    def tokenize(self, text: str) -> list[int]:
        raw = text.encode()
        ids = (self.ll.llama_token * (len(raw) + 8))()
        n = self.ll.llama_tokenize(self.vocab, raw, len(raw), ids, len(ids), False, False)
        return list(ids[:n])

    def greedy(self, prompt: list[int], new_tokens: int):
        """Greedy tokens after `prompt` (the cache cleared first), and each step's logits."""
        import numpy as np

        ll = self.ll
        ll.llama_memory_clear(ll.llama_get_memory(self.ctx), True)
        feed, tokens, logits = list(prompt), [], []
        for _ in range(new_tokens):
            ids = (ll.llama_token * len(feed))(*feed)
            if ll.llama_decode(self.ctx, ll.llama_batch_get_one(ids, len(feed))) != 0:
                raise Refusal("llama_decode failed")
            row = np.ctypeslib.as_array(ll.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,)).copy()
            logits.append(row)
            tokens.append(int(row.argmax()))
            feed = [tokens[-1]]
        return tokens, np.stack(logits)

    def close_context(self) -> None:
        if self.ctx:
            self.ll.llama_free(self.ctx)
            self.ctx = None

    def close(self) -> None:
        self.close_context()
        self.ll.llama_model_free(self.model)


def transformers_greedy(model, prompt: list[int], new_tokens: int):
    """Greedy tokens (no stop) and each step's last-position logits, a full forward each step."""
    import numpy as np
    import torch

    ids, tokens, logits = torch.tensor([prompt]), [], []
    with torch.no_grad():
        for _ in range(new_tokens):
            row = model(ids, use_cache=False).logits[0, -1]
            logits.append(row.numpy())
            tokens.append(int(row.argmax()))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return tokens, np.stack(logits)


def greedy_agreement(engine: LlamaCpp, expected: list[tuple[list[int], list[int], object]], new_tokens: int):
    """Prompts whose llama.cpp greedy tokens equal `expected`'s (prompt ids, tokens, logits), and
    the largest logit difference up to each prompt's first differing token."""
    import numpy as np

    same, worst = 0, 0.0
    for ids, theirs, theirs_logits in expected:
        ours, ours_logits = engine.greedy(ids, new_tokens)
        same += ours == theirs
        steps = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), new_tokens) + 1
        worst = max(worst, float(np.abs(ours_logits[:steps] - theirs_logits[:steps]).max()))
    return same, worst


def check_model(name: str, folder: Path, gguf: Path, heads: tuple[int, ...], prompts, new_tokens, threads) -> str:
    """One line: llama.cpp's per-layer KV heads, tokenizer, greedy tokens (flash attention off:
    float32 throughout; on: llama.cpp's default) and KV cache bytes against the arithmetic."""
    from transformers.utils import logging as transformers_logging

    import uptrain.modeling  # noqa: F401  registers the DeciLM layout's classes with transformers
    from uptrain.loading import load_model, load_tokenizer

    transformers_logging.disable_progress_bar()  # one line a model, not its loading bars

    model = load_model(folder, "checkpoint").eval()
    tokenizer = load_tokenizer(folder, "checkpoint")
    head_dim = json.loads((folder / "config.json").read_text())["head_dim"]
    prompt_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts]
    expected = [(ids, *transformers_greedy(model, ids, new_tokens)) for ids in prompt_ids]
    engine = LlamaCpp(gguf, threads)
    try:
        same_ids = sum(engine.tokenize(text) == ids for text, ids in zip(prompts, prompt_ids))
        greedy, caches = {}, {}
        for flash in (False, True):
            engine.open(flash)
            greedy[flash] = greedy_agreement(engine, expected, new_tokens)
            # CACHE_CELLS positions: one KV head of one layer is exactly 1 MiB, so the log's MiB are exact
            caches[flash] = engine.open(flash, CACHE_CELLS)
    finally:
        engine.close()
    head_mib = CACHE_CELLS * head_dim * 4
    per_layer = head_mib * sum(heads)
    # Without flash attention llama.cpp keeps V transposed, each layer padded to the largest
    # layer's heads (its TAG_V_CACHE_VARIABLE); with it, each layer's own.
    padded = head_mib * len(heads) * max(heads)
    arithmetic = {True: (per_layer, per_layer), False: (per_layer, padded)}
    ok = engine.kv_heads == heads and same_ids == len(prompts) and caches == arithmetic
    ok = ok and all(same == len(prompts) for same, _ in greedy.values())
    n = len(prompts)

    def mib(pair):
        return "K {} + V {} MiB".format(*(b // 2**20 for b in pair))

    return (
        f"{name}: {'OK' if ok else 'MISMATCH'} — llama.cpp's n_head_kv {list(engine.kv_heads)} "
        f"(converted: {list(heads)}); tokenizer = transformers' on {same_ids}/{n} passages; greedy tokens = "
        f"transformers' (float32, {new_tokens} new each) on {greedy[False][0]}/{n} with flash attention off "
        f"(max |Δlogit| {greedy[False][1]:.1e}), {greedy[True][0]}/{n} on ({greedy[True][1]:.1e}); "
        f"KV cache of {CACHE_CELLS} positions, flash attention on: {mib(caches[True])} "
        f"(Σ heads {sum(heads)}: {mib(arithmetic[True])}), off: {mib(caches[False])} "
        f"(V padded to {len(heads)} · {max(heads)} heads: {mib(arithmetic[False])})"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "uptrain-gguf")
    p.add_argument("--version", default="0.3.36", help="llama-cpp-python sdist (default: 0.3.36)")
    p.add_argument("--prompts", type=int, default=4, help="passages of the shipped test split (default: 4)")
    p.add_argument("--new-tokens", type=int, default=24, help="greedy tokens a passage (default: 24)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (default: 2)")
    p.add_argument("--convert", nargs=2, metavar=("SRC", "GGUF"), help=argparse.SUPPRESS)
    p.add_argument("--llama-cpp", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.convert:
        converter_main(*args.convert, args.llama_cpp)
        return 0
    started = time.monotonic()
    try:
        require_tools()
        root = fetch_llama_cpp(args.cache, args.version)
        site = ensure_site(args.cache)
        lib = build_llama_cpp(args.cache, root, args.version)
        sys.path[:0] = [str(site), str(root)]
        os.environ["LLAMA_CPP_LIB_PATH"] = str(lib)
        models = args.cache / "models"
        models.mkdir(exist_ok=True)
        prompts = corpus_prompts(args.prompts)
        ok = True
        for name, (folder, source, heads) in converted_models(models).items():
            gguf = models / f"{name}.f32.gguf"
            if not gguf.is_file():
                convert_to_gguf(source, gguf, root / "vendor" / "llama.cpp", site)
            line = check_model(name, folder, gguf, heads, prompts, args.new_tokens, args.threads)
            ok = ok and ": OK" in line
            print(line, flush=True)
    except Refusal as err:
        print(f"check_gguf: {err}", file=sys.stderr)
        return 1
    print(f"llama-cpp-python {args.version}; {time.monotonic() - started:.0f} s of wall time")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
