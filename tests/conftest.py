import copy
import os
import sys
import tempfile
from pathlib import Path

# one thread per process, the commands the tests start included (they inherit this environment): two pytest-xdist
# workers share the 2 cores, and a second thread per process only waits on the other worker's
os.environ.setdefault("OMP_NUM_THREADS", "1")
# each worker its own copy of the exports' modeling files: transformers guards its shared cache with a lock of one
# process only, so two workers reloading exports at once could import a half-written file
os.environ.setdefault("HF_MODULES_CACHE", tempfile.mkdtemp(prefix=f"hf-modules-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-"))

import pytest  # noqa: E402
import torch  # noqa: E402

for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(var, "1")
os.environ.setdefault("WANDB_MODE", "offline")
sys.path.insert(0, str(Path(__file__).parent))

from families import FAMILIES, tiny_model  # noqa: E402

torch.set_num_threads(1)  # tiny matrices: extra threads only wait on each other (16 ms per linear on a busy 2-core box)


@pytest.fixture(autouse=True)
def machine_cache(tmp_path_factory, monkeypatch) -> Path:
    """Each test its own machine cache of latency fits (``costs.table.machine_dir``): a fit a test timed with a fake
    timer is no other test's, nor the user's. The commands a test starts inherit it."""
    path = tmp_path_factory.mktemp("machine-cache")
    monkeypatch.setenv("GATEDPRUNE_CACHE", str(path))
    return path


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


# the longest files first, by their seconds in a full run (2026-12-07): pytest-xdist (--dist loadfile, with
# --no-loadscope-reorder in the Makefile, else it orders files by their number of tests) hands whole files to the two
# workers in collection order, so a long file collected last would leave one worker idle at the end
HEAVY_FIRST = ("test_benchmarks.py", "test_bad_input.py", "test_gates_benchmark.py", "test_reliability.py",
               "test_reliability_finetune.py", "test_train_costs.py", "test_structure.py", "test_reliability_sweep.py",
               "test_wheel.py", "test_baselines.py", "test_readme_commands.py", "test_train_kinds.py")


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order
