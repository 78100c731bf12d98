import os
import sys
from pathlib import Path

import pytest

for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(var, "1")
os.environ.setdefault("WANDB_MODE", "offline")
sys.path.insert(0, str(Path(__file__).parent))

from families import FAMILIES  # noqa: E402


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param
