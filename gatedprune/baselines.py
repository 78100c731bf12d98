"""Moved to ``gatedprune.methods.baselines``: this path stays for the ``_target_``s written before (``pruning=michel|astar|random``)."""

from gatedprune.methods.baselines import *  # noqa: F401,F403
from gatedprune.methods.baselines import AStar, Michel, Random  # noqa: F401
