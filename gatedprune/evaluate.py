"""``python -m gatedprune.evaluate``: the ``gatedprune-evaluate`` command. The names this module once held are looked
up where they live now (``gatedprune.moved``)."""

from gatedprune.moved import lookup

__getattr__ = lookup("gatedprune.evaluate")

if __name__ == "__main__":
    import sys

    from gatedprune.cli import evaluate_command

    sys.exit(evaluate_command())
