"""Moved to ``gatedprune.reports.evaluate`` (the command) and ``gatedprune.reports.scoring`` (the primitives): this
path stays for ``python -m gatedprune.evaluate`` and the configs runs recorded before (their ``test_generation``)."""

from gatedprune.reports.evaluate import *  # noqa: F401,F403
from gatedprune.reports.evaluate import evaluate_dir  # noqa: F401
from gatedprune.reports.scoring import *  # noqa: F401,F403  (the scoring primitives lived here too)
from gatedprune.reports.scoring import GenerationConfig  # noqa: F401  (the _target_ of runs recorded before)


if __name__ == "__main__":  # python -m gatedprune.evaluate (the command's own module): the command, as documented
    import sys

    from gatedprune.cli import evaluate_command

    sys.exit(evaluate_command())
