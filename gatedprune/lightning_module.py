"""Moved to ``gatedprune.training.module``: this path stays for the ``_target_``s written before (``module=gated``, ``optim``)."""

from gatedprune.training.module import *  # noqa: F401,F403
from gatedprune.training.module import GatedSeq2Seq, OptimConfig  # noqa: F401
