"""Moved to ``gatedprune.training.csv_logger``: this path stays for the configs runs recorded before."""

from gatedprune.training.csv_logger import *  # noqa: F401,F403
from gatedprune.training.csv_logger import ResumableCSVLogger  # noqa: F401
