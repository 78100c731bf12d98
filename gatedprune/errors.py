"""How every gatedprune command ends when something goes wrong: one line on stderr, ``error: ...``, and an exit code.

- exit 2: bad input (a value, path or file that cannot work), refused before anything is written;
- exit 1: good input, but the run could not produce a valid result (it diverged, or the pruned model did not
  verify).

``GATEDPRUNE_DEBUG=1`` shows the traceback instead. Hydra's own errors (a mistyped key, an unknown option) are
folded into one line as well.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class RunFailed(RuntimeError):
    """The input was fine, but the result is not valid (the message carries the numbers)."""


BAD_INPUT = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError)
RUN_FAILURES = (RunFailed, FloatingPointError)  # FloatingPointError: a run that diverged (optim.max_bad_steps)


def one_line(text: str) -> str:
    """The lines of a message joined by "; ", or by a space after a colon (Hydra's config search path: left out)."""
    lines = [" ".join(line.split()) for line in text.split("Config search path")[0].splitlines() if line.strip()]
    return "".join(line + ("" if i == len(lines) - 1 else " " if line.endswith(":") else "; ") for i, line in enumerate(lines))


def fail(message: str, code: int = 2) -> int:
    """Print ``error: message`` (one line) on stderr; returns ``code`` for the caller to exit with."""
    print(f"error: {one_line(message)}", file=sys.stderr)
    return code


def exit_code(err: BaseException) -> int | None:
    """2 for bad input, 1 for a failed run, None for anything else (a bug: its traceback should show)."""
    if os.environ.get("GATEDPRUNE_DEBUG"):
        return None
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(err, (*BAD_INPUT, OmegaConfBaseException)):  # OmegaConf: a mandatory value left unset, say
        return 2
    if isinstance(err, RUN_FAILURES):
        return 1
    return None


def run_reported(function: Callable[[], object]) -> int:
    """Call ``function``; 0 if it returns, else the error reported in one line and its exit code."""
    try:
        function()
    except Exception as err:
        code = exit_code(err)
        if code is None:
            raise
        return fail(str(err), code)
    return 0


@contextmanager
def reported_errors() -> Iterator[None]:
    """Exit with ``error: ...`` and 2 or 1 for bad input and failed runs raised inside."""
    try:
        yield
    except Exception as err:
        code = exit_code(err)
        if code is None:
            raise
        sys.exit(fail(str(err), code))


def run_hydra_app(app: Callable[[], object]) -> None:
    """Run a ``@hydra.main`` function; a config Hydra cannot compose is bad input like any other.

    Hydra prints such errors over several lines and exits 1; with ``HYDRA_FULL_ERROR`` it raises them instead,
    and they are reported here in one line.
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        app()
    except (HydraException, OmegaConfBaseException) as err:
        if os.environ.get("GATEDPRUNE_DEBUG"):
            raise
        first, *advice = one_line(str(err)).split("; ")
        cause = f": {one_line(str(err.__cause__)).split('; ')[0]}" if err.__cause__ is not None else ""
        sys.exit(fail(first.rstrip(".") + cause + (f" ({'; '.join(advice)})" if advice else ""), 2))
