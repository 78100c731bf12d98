"""The package's old module paths in one table: each module the top level once had, and where its names live now.

Runs recorded before the package had subfolders name ``_target_``s such as ``gatedprune.finetune.FineTuneConfig``
or ``gatedprune.baselines.Random``, and code written then imports ``gatedprune.adapters``. ``install`` (called by
the package's ``__init__``) serves each old module that is no file from this table, and the command entry points
that kept a file (``python -m gatedprune.evaluate``) take their names from it too (``lookup``): nothing is copied,
and the top level shows the package's layers.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

MOVED: dict[str, tuple[str, ...]] = {  # old module: the modules its names are looked up in, in order
    "gatedprune.adapters": ("gatedprune.structures.adapters",),
    "gatedprune.analyze": ("gatedprune.reports.analysis", "gatedprune.reports.head_report"),
    "gatedprune.baselines": ("gatedprune.methods.baselines", "gatedprune.methods.random_draw"),
    "gatedprune.callbacks": ("gatedprune.training.callbacks",),
    "gatedprune.csv_logger": ("gatedprune.training.csv_logger",),
    "gatedprune.evaluate": ("gatedprune.reports.evaluate", "gatedprune.reports.scoring"),
    "gatedprune.export": ("gatedprune.shipping.export",),
    "gatedprune.finetune": ("gatedprune.shipping.finetune",),
    "gatedprune.lightning_module": ("gatedprune.training.module",),
    "gatedprune.model_loading": ("gatedprune.surgery.model_loading",),
    "gatedprune.sweep": ("gatedprune.reports.sweep",),
}


def lookup(old: str):
    """A module ``__getattr__`` (PEP 562) for the old module ``old``: each name from where it lives now."""

    def __getattr__(name: str):
        if name == "__all__":  # from <old> import *: every public name of the modules it moved to
            return sorted({n for new in MOVED[old] for n in _public(importlib.import_module(new))})
        if name.startswith("__"):  # the import system's own probes (__path__, __file__, ...)
            raise AttributeError(name)
        for new in MOVED[old]:
            module = importlib.import_module(new)
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r} (its names moved to {', '.join(MOVED[old])})")

    return __getattr__


def _public(module: types.ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    return list(names) if names is not None else [n for n, v in vars(module).items() if not n.startswith("_")
                                                  and not isinstance(v, types.ModuleType)]


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """After the file finders: an old module with no file of its own is made from the table."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        module = types.ModuleType(spec.name, f"Moved: its names live in {', '.join(MOVED[spec.name])} "
                                             "(gatedprune.moved).")
        module.__getattr__ = lookup(spec.name)
        return module

    def exec_module(self, module) -> None:
        pass


def install() -> None:
    """Serve the old modules (once per process), after every finder of real files."""
    if not any(isinstance(finder, _Moved) for finder in sys.meta_path):
        sys.meta_path.append(_Moved())
