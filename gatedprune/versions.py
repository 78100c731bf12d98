"""The versions a run or an export records: gatedprune's own (from the installed package's metadata) and its
main dependencies'."""

from __future__ import annotations

import platform


def version() -> str:
    """The installed gatedprune's version, from the package metadata ("unknown" when run from a bare clone)."""
    from importlib.metadata import PackageNotFoundError, version as installed

    try:
        return installed("gatedprune")
    except PackageNotFoundError:
        return "unknown"


def versions() -> dict[str, str]:
    """gatedprune, Python, torch, transformers and Lightning, as ``metrics.json`` and every export record them."""
    import lightning
    import torch
    import transformers

    return {"gatedprune": version(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "lightning": lightning.__version__}
