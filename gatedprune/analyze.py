"""``python -m gatedprune.analyze``: the ``gatedprune-analyze`` command. The names this module once held are looked
up where they live now (``gatedprune.moved``)."""

from gatedprune.moved import lookup

__getattr__ = lookup("gatedprune.analyze")

if __name__ == "__main__":
    import sys

    from gatedprune.cli import analyze_command

    sys.exit(analyze_command())
