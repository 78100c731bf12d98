"""``python -m gatedprune <command> [arguments]``: train, export, finetune, sweep, evaluate, analyze or latency (the gatedprune-* commands)."""

import os
import sys

from gatedprune.cli import COMMANDS

if os.environ.get("LOCAL_RANK") and (len(sys.argv) < 2 or sys.argv[1] not in COMMANDS):
    # a DDP process that Lightning started by running `python -m gatedprune.__main__ <arguments>` again: the
    # arguments it passes on are train's, without the command word
    sys.argv.insert(1, "train")
if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
    wrong = f"unknown command {sys.argv[1]}" if len(sys.argv) > 1 else "no command given"
    print(f"error: {wrong}; usage: python -m gatedprune {{{','.join(COMMANDS)}}} [arguments]; e.g. python -m "
          "gatedprune export --help", file=sys.stderr)
    sys.exit(2)
command = COMMANDS[sys.argv[1]]
sys.argv = [f"gatedprune-{sys.argv[1]}", *sys.argv[2:]]
sys.exit(command())
