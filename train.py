"""Entry point of a clone: `python train.py [overrides]`, e.g. `python train.py experiment=smoke pruning.l0_lambda=0.05`.

The same Hydra app as the installed `gatedprune-train` (gatedprune/cli.py); `conf/` links to its configs.
"""

from gatedprune.cli import train_command

if __name__ == "__main__":
    train_command()
