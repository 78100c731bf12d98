"""Moved to ``gatedprune.training.callbacks``: this path stays for the configs runs recorded before."""

from gatedprune.training.callbacks import *  # noqa: F401,F403
from gatedprune.training.callbacks import DenseCheckpoint, LastCheckpoint  # noqa: F401
