"""The methods that decide what goes: each a config option (``pruning=<name>``) that runs itself (``base.Method``).

Gates trained with a penalty or a budget (``gated``), and the literature's baselines that score a trained model
(``baselines``). The names below keep the ``_target_`` paths written before the package had subfolders
(``gatedprune.methods.L0``) working.
"""

from gatedprune.methods.baselines import AStar, Michel, PlanMethod
from gatedprune.methods.random_draw import Random
from gatedprune.methods.base import Method
from gatedprune.methods.even_layers import EvenLayers
from gatedprune.methods.gated import L0, GatedPruning, L0Budget
from gatedprune.methods.recover import Recover

__all__ = ["AStar", "EvenLayers", "GatedPruning", "L0", "L0Budget", "Method", "Michel", "PlanMethod", "Random", "Recover"]
