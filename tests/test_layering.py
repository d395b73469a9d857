"""uptrain's modules import one another in one direction: no cycles, nothing upward.

Every import in every module under `uptrain/` counts, including those inside functions (a
function-level import hides a cycle from Python's import order, not from the design). An
import names the module it reads: `from uptrain.train import metrics` is an import of
`uptrain.train.metrics`, `from uptrain.convert.plan import DTYPES` one of `uptrain.convert.plan`.
(That importing a submodule first runs its package's `__init__` is not counted: a package and
its modules are one layer.)
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A module may import modules of its own layer or of any layer below it, never one
# above. `name.*` is a package with all its modules; a plain name is that module alone.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # No uptrain dependencies beyond each other: the error type, strict JSON, what a config says,
    # and the one tokenizer and model loader (every layer loads tokenizers).
    ("leaves", ("uptrain", "uptrain.strict_json", "uptrain.options", "uptrain.model_info", "uptrain.loading")),
    # What each architecture is (attention sites, quirks, uptrain's modeling of it), as data.
    ("architecture", ("uptrain.architecture.*",)),
    # Safetensors reading and writing, atomic folders and locks, the resume rule of resumable folders,
    # sources, digests, provenance, cards.
    ("checkpoint", ("uptrain.checkpoint.*",)),
    # The registry of objectives (what each reads, its special tokens, lengths) and their corruptions
    # (span corruption, text infilling) of token blocks, as pure functions.
    ("objectives", ("uptrain.objectives.*",)),
    # Pretraining budgets (read from cards and provenance) and the data package: text → token blocks,
    # token shards (`uptrain tokenize`'s folder, its reader and the engine that writes it), the
    # shipped corpus, the training and evaluation batches, the objectives' batches, pairs, document masks.
    ("data", ("uptrain.budgets", "uptrain.data.*")),
    # GQA modeling for GPT-2, NeoX, OPT, GPT-J, BLOOM and the encoder–decoders (T5, BART, mBART,
    # Marian, Whisper); importing it registers them with transformers.
    ("modeling", ("uptrain.modeling.*",)),
    # vLLM model classes for the GQA architectures (`vllm.general_plugins` entry point); imports vLLM.
    ("serving", ("uptrain.vllm_plugin.*",)),
    ("convert", ("uptrain.convert.*",)),
    ("train", ("uptrain.train.*",)),
    # Inference speed and KV-cache memory of a checkpoint (`uptrain speed`; compare reports it).
    ("speed", ("uptrain.speed", "uptrain.speed_checks", "uptrain.speed_vllm")),
    # Task metrics (`uptrain evaluate`; compare's task columns): generation, the metric libraries, lm-eval.
    ("evaluation", ("uptrain.evaluation.*",)),
    ("compare", ("uptrain.compare.*",)),
    # The commands.
    (
        "commands",
        ("uptrain.cli", "uptrain.__main__", "uptrain.demo", "uptrain.inspect_checkpoint", "uptrain.inspect_latent"),
    ),
]


def module_names(package_dir: Path) -> dict[str, Path]:
    """Dotted name → file of every module under `package_dir` (a package's is its __init__.py)."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that module `name` imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def add(target: str) -> None:
        # The module itself where it is one, else the closest enclosing one (`import a.b.c`
        # of a name that is not a module, `from a.b import function`).
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target:
            found.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source)
    found.discard(name)  # a package's __init__ naming its own attributes
    return found


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    modules = module_names(package_dir)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every group of modules that import one another, directly or round a loop (Tarjan's
    strongly connected components of more than one module), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer_of(module: str, layers=LAYERS) -> int | None:
    for i, (_, members) in enumerate(layers):
        for member in members:
            if module == member.removesuffix(".*") or (member.endswith(".*") and module.startswith(member[:-1])):
                return i
    return None


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """One line per import of a module in a higher layer than the importer's."""
    wrong = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            mine, theirs = layer_of(module, layers), layer_of(target, layers)
            if mine is not None and theirs is not None and theirs > mine:  # unplaced: the test above
                wrong.append(f"{module} ({layers[mine][0]}) imports {target} ({layers[theirs][0]})")
    return wrong


def test_every_module_has_a_layer():
    unplaced = [m for m in import_graph(ROOT / "uptrain") if layer_of(m) is None]
    assert not unplaced, f"place these modules in LAYERS of {Path(__file__).name}: {unplaced}"


def test_no_import_cycles():
    found = cycles(import_graph(ROOT / "uptrain"))
    assert not found, "modules that import each other: " + "; ".join(" ↔ ".join(c) for c in found)


def test_nothing_imports_upward():
    wrong = upward_imports(import_graph(ROOT / "uptrain"))
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_the_checks_see_imports_inside_functions_and_relative_ones(tmp_path):
    """A cycle closed by an import inside a function, and an upward import written relatively,
    are both found (the checks above can fail)."""
    package = tmp_path / "uptrain"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("")
    (package / "low" / "a.py").write_text("from uptrain.low import b\n")
    (package / "low" / "b.py").write_text("def f():\n    from . import c\n")
    (package / "low" / "c.py").write_text("import uptrain.low.a\nfrom ..high import thing\n")
    (package / "high.py").write_text("import os\n")
    graph = import_graph(package)
    assert graph["uptrain.low.c"] == {"uptrain.low.a", "uptrain.high"}
    assert cycles(graph) == [["uptrain.low.a", "uptrain.low.b", "uptrain.low.c"]]
    layers = [("low", ("uptrain", "uptrain.low.*")), ("high", ("uptrain.high",))]
    assert upward_imports(graph, layers) == ["uptrain.low.c (low) imports uptrain.high (high)"]
