"""Latency fits on disk: ``latency-<key>.json`` beside the checkpoint they were measured for, reused by forks, and in
this machine's cache (``machine_dir``), reused by every later run here; or a table measured on another machine
(``gatedprune-latency`` on the user's server, given as ``pruning.workload.table``).

The key is what the times depend on: the model's shapes (not its weights), the device, the runtime and its version,
and the workload. A table from elsewhere must match in shapes and workload; its device is the point of it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from gatedprune.costs.counts import features, kind_sites
from gatedprune.costs.linear import LinearCost
from gatedprune.costs.workload import Workload
from gatedprune.reports.speed import cpu_name
from gatedprune.utils import write_json

FORMAT = 1  # of the file
# in a cache's key; a table from elsewhere may have been measured otherwise
HOW_MEASURED = {"repeats", "probe_fractions", "joint_probes"}


def shapes(model: nn.Module) -> dict:
    """What a model's latency depends on besides the workload: family, widths, structures per kind."""
    sizes = {}
    for kind, sites in kind_sites(model).items():
        site = next((s for s in sites if s.num_units), None)
        if site is not None and hasattr(site, "head_dim"):
            sizes[kind] = site.head_dim
    output = model.get_output_embeddings()
    return {"model_type": model.config.model_type, "d_model": output.in_features, "vocab": output.out_features,
            "structures": features(model), "head_dims": sizes, "dtype": str(next(model.parameters()).dtype)}


def machine_dir() -> Path:
    """Where a fit measured on this machine is kept for every later run on it: ``$GATEDPRUNE_CACHE/latency``, else
    ``$XDG_CACHE_HOME/gatedprune/latency``, else ``~/.cache/gatedprune/latency``. Two fits timed on a shared machine
    price the kinds apart by more than the plan can bear (docs/gates.md 0c), so a machine times each key once, as an
    autotuner keeps its tuning."""
    root = os.environ.get("GATEDPRUNE_CACHE")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gatedprune"
    return Path(root) / "latency"


def device_name(workload: Workload) -> str:
    """The processor the times are for, e.g. "AMD EPYC 7B13, 2 logical CPUs, 1 thread"."""
    if workload.device == "cuda":
        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda (absent)"
    threads = workload.threads or torch.get_num_threads()
    return f"{cpu_name()}, {os.cpu_count()} logical CPUs, {threads} thread{'s' * (threads > 1)}"


def runtime_version(runtime: str) -> str:
    if runtime == "ct2":
        import ctranslate2

        return f"ctranslate2 {ctranslate2.__version__}"
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}"


def key(model: nn.Module, workload: Workload) -> dict:
    return {"shapes": shapes(model), "device": device_name(workload), "runtime": runtime_version(workload.runtime),
            "workload": workload.decoding()}


def file_name(key_: dict) -> str:
    digest = hashlib.sha1(json.dumps(key_, sort_keys=True).encode()).hexdigest()[:12]
    return f"latency-{digest}.json"


def save(path: Path, key_: dict, cost: LinearCost, probes: list[dict]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # the machine's cache, the first time
    write_json(path, {"gatedprune_latency_table": FORMAT, "key": key_, "unit": "seconds", "base": cost.base,
                      "coefficients": cost.coefficients, "probes": probes})


def read(path: Path) -> tuple[dict, LinearCost, list[dict]]:
    """(key, cost, the probes it was fitted to, if saved) of a table file; ``ValueError`` naming the file for one
    that is not a latency table."""
    try:
        data = json.loads(Path(path).read_text())
        if data.get("gatedprune_latency_table") != FORMAT:
            raise KeyError("gatedprune_latency_table")
        cost = LinearCost("latency", float(data["base"]), {k: float(v) for k, v in data["coefficients"].items()})
        return data["key"], cost, list(data.get("probes") or [])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"pruning.workload.table={path}: not a gatedprune latency table ({type(err).__name__}: "
                         f"{err}); allowed: a file written by gatedprune-latency") from None


def check_match(path: Path, saved: dict, wanted: dict) -> None:
    """A table measured elsewhere is for this model and workload (its device and runtime version may differ)."""
    for part in ("shapes", "workload"):
        for field in sorted((set(saved[part]) | set(wanted[part])) - HOW_MEASURED):
            if saved[part].get(field) != wanted[part].get(field):
                raise ValueError(f"pruning.workload.table={path} was measured for {part} {field}="
                                 f"{saved[part].get(field)!r}, this run has {wanted[part].get(field)!r}; allowed: a "
                                 f"table measured with this model's shapes and pruning.workload")
