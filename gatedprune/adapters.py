"""Moved to ``gatedprune.structures.adapters``: this path stays for code written before (``pin_layout``, ``probe``)."""

from gatedprune.structures.adapters import *  # noqa: F401,F403
from gatedprune.structures.adapters import attention_sites, pin_layout, probe  # noqa: F401
