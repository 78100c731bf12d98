"""Moved to ``gatedprune.shipping.finetune``: this path stays for the configs runs recorded before."""

from gatedprune.shipping.finetune import *  # noqa: F401,F403
from gatedprune.shipping.finetune import FineTuneConfig  # noqa: F401
