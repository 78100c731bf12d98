"""Moved to ``gatedprune.reports.sweep``: this path stays for ``gatedprune.sweep.summarise`` and ``python -m gatedprune.sweep``."""

from gatedprune.reports.sweep import *  # noqa: F401,F403
from gatedprune.reports.sweep import summarise  # noqa: F401


if __name__ == "__main__":  # python -m gatedprune.sweep (the command's own module): the command, as documented
    import sys

    from gatedprune.cli import sweep_command

    sys.exit(sweep_command())
