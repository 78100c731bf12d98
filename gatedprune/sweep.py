"""``python -m gatedprune.sweep``: the ``gatedprune-sweep`` command. The names this module once held are looked
up where they live now (``gatedprune.moved``)."""

from gatedprune.moved import lookup

__getattr__ = lookup("gatedprune.sweep")

if __name__ == "__main__":
    import sys

    from gatedprune.cli import sweep_command

    sys.exit(sweep_command())
