"""Entry point: `python train.py [overrides]`, e.g. `python train.py experiment=smoke pruning.l0_lambda=0.05`.

Returns the metric named by `optimized_metric` so Hydra sweepers can optimise it.
"""

import os
import shutil
import sys
from pathlib import Path

import hydra
from hydra.errors import InstantiationException
from omegaconf import DictConfig

from gatedprune.train import set_offline_defaults, train


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float:
    try:
        metrics = train(cfg)
    except (ValueError, FileNotFoundError, FloatingPointError, InstantiationException) as err:
        cause = err.__cause__ if isinstance(err, InstantiationException) else err
        if os.environ.get("GATEDPRUNE_DEBUG") or not isinstance(cause, (ValueError, FileNotFoundError, FloatingPointError)):
            raise
        print(f"error: {cause}", file=sys.stderr)
        _remove_empty_run_dir(Path(cfg.paths.output_dir))
        sys.exit(2)
    return float(metrics[cfg.optimized_metric])


def _remove_empty_run_dir(run_dir: Path) -> None:
    """A run refused for bad input leaves nothing behind but what Hydra wrote before it started."""
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {".hydra", "train.log", "status.json"}:
        shutil.rmtree(run_dir)


if __name__ == "__main__":
    set_offline_defaults()
    main()
