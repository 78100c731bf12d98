"""``python -m gatedprune.finetune``: the ``gatedprune-finetune`` command. The names this module once held are looked
up where they live now (``gatedprune.moved``)."""

from gatedprune.moved import lookup

__getattr__ = lookup("gatedprune.finetune")

if __name__ == "__main__":
    import sys

    from gatedprune.cli import finetune_command

    sys.exit(finetune_command())
