"""Moved to ``gatedprune.shipping.finetune``: this path stays for the configs runs recorded before."""

from gatedprune.shipping.finetune import *  # noqa: F401,F403
from gatedprune.shipping.finetune import FineTuneConfig  # noqa: F401


if __name__ == "__main__":  # python -m gatedprune.finetune: the gatedprune-finetune command, as the others run
    import sys

    from gatedprune.cli import finetune_command

    sys.exit(finetune_command())
