"""The optional packages a format needs (``pip install 'gatedprune[deploy]'``), checked before anything loads."""

from __future__ import annotations

import importlib.util

EXTRA = "deploy"


def require(fmt: str, packages: tuple[str, ...], option: str | None = None) -> None:
    """Refuse ``fmt`` (or the ``option`` that needs it) in one line naming the missing packages and the extra that
    installs them."""
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"{option or '--format ' + fmt} needs {', '.join(missing)}, not installed; install the extra: "
                         f"pip install 'gatedprune[{EXTRA}]'")
