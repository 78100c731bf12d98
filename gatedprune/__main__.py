"""``python -m gatedprune <command> [arguments]``: train, export, sweep or evaluate (the gatedprune-* commands)."""

import sys

from gatedprune.cli import COMMANDS

if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
    print(f"usage: python -m gatedprune {{{','.join(COMMANDS)}}} [arguments]; e.g. python -m gatedprune export --help",
          file=sys.stderr)
    sys.exit(2)
command = COMMANDS[sys.argv[1]]
sys.argv = [f"gatedprune-{sys.argv[1]}", *sys.argv[2:]]
sys.exit(command())
