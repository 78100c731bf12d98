"""Moved to ``gatedprune.methods.baselines`` and ``random_draw``: this path stays for the ``_target_``s written before (``pruning=michel|astar|random``)."""

from gatedprune.methods.baselines import *  # noqa: F401,F403
from gatedprune.methods.baselines import AStar, Michel  # noqa: F401
from gatedprune.methods.random_draw import Random  # noqa: F401
