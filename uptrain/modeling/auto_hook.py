"""Register uptrain's GQA architectures with transformers' Auto classes when they are loaded.

`import uptrain` must stay fast, so it does not import transformers. Instead it installs
this import hook: once `transformers.models.auto.modeling_auto` (where `AutoModelForCausalLM`
lives) has been imported, and no transformers module is still half-imported (our modeling
files import transformers' GPT-2, GPT-NeoX, … modules, which may be the very import that
pulled the auto classes in), `uptrain.modeling.register()` runs once and the hook removes
itself. If transformers was imported before uptrain, registration happens at once.
"""

from __future__ import annotations

import sys
import warnings

AUTO_MODULE = "transformers.models.auto.modeling_auto"


# Registration imports uptrain's modeling files, which import transformers' modeling modules:
# it must wait until no module of either is half-imported, and be retried as each completes.
WATCHED = ("transformers", "uptrain.modeling")


def _half_imported() -> bool:
    # importlib marks a module's spec `_initializing` while its body runs.
    return any(getattr(getattr(m, "__spec__", None), "_initializing", False)
               for name, m in list(sys.modules.items()) if name.startswith(WATCHED))


class _RegisterOnImport:
    """A meta path finder (duck-typed: importlib.abc alone costs 7 ms at start-up) that watches
    transformers' and uptrain's modeling imports and registers after the first one that leaves
    the auto classes fully imported."""

    def find_spec(self, name, path, target=None):
        if not name.startswith(tuple(prefix + "." for prefix in WATCHED)):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            spec._initializing = False  # this module is complete; importlib resets it right after
            maybe_register()

        loader.exec_module = exec_then_register
        return spec


_finder = _RegisterOnImport()
_registered = False


def maybe_register() -> None:
    global _registered
    if _registered or AUTO_MODULE not in sys.modules or _half_imported():
        return
    _registered = True
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    try:
        from uptrain.modeling import register

        register()
    except Exception as err:  # a transformers version without these classes must not break its imports
        warnings.warn(f"uptrain could not register its GQA architectures with transformers: {err}", stacklevel=2)


def install() -> None:
    """Register now if transformers' auto classes are loaded, else when they are."""
    if AUTO_MODULE in sys.modules:
        maybe_register()
    elif _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
