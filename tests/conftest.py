import copy
import os
import sys
from pathlib import Path

import pytest
import torch

for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(var, "1")
os.environ.setdefault("WANDB_MODE", "offline")
sys.path.insert(0, str(Path(__file__).parent))

from families import FAMILIES, tiny_model  # noqa: E402

torch.set_num_threads(1)  # tiny matrices: extra threads only wait on each other (16 ms per linear on a busy 2-core box)


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_of(tmp_path_factory):
    """``model_of(family)``: a fresh copy of the family's tiny random model (each built once per module)."""
    built = {}

    def get(family: str):
        if family not in built:
            built[family] = tiny_model(family, tmp_path_factory.mktemp(family))
        return copy.deepcopy(built[family])

    return get
