"""Moved to ``gatedprune.shipping.export``: this path stays for ``python -m gatedprune.export``."""

from gatedprune.shipping.export import *  # noqa: F401,F403
from gatedprune.shipping.export import export_checkpoint, export_gated  # noqa: F401


if __name__ == "__main__":  # python -m gatedprune.export (the command's own module): the command, as documented
    import sys

    from gatedprune.cli import export_command

    sys.exit(export_command())
