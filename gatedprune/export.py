"""``python -m gatedprune.export``: the ``gatedprune-export`` command. The names this module once held are looked
up where they live now (``gatedprune.moved``)."""

from gatedprune.moved import lookup

__getattr__ = lookup("gatedprune.export")

if __name__ == "__main__":
    import sys

    from gatedprune.cli import export_command

    sys.exit(export_command())
