"""Moved to ``gatedprune.reports.analysis``: this path stays for ``python -m gatedprune.analyze``."""

from gatedprune.reports.analysis import *  # noqa: F401,F403
from gatedprune.reports.analysis import analyze  # noqa: F401
from gatedprune.reports.head_report import *  # noqa: F401,F403  (the report's writers lived here too)
from gatedprune.reports.head_report import write_report  # noqa: F401


if __name__ == "__main__":  # python -m gatedprune.analyze (the command's own module): the command, as documented
    import sys

    from gatedprune.cli import analyze_command

    sys.exit(analyze_command())
