"""Moved to ``gatedprune.surgery.model_loading``: this path stays for the ``_target_`` written before (``model=...``)."""

from gatedprune.surgery.model_loading import *  # noqa: F401,F403
from gatedprune.surgery.model_loading import load_model, load_pruned  # noqa: F401
