"""Entry point: `python train.py [overrides]`, e.g. `python train.py experiment=smoke pruning.l0_lambda=0.05`.

Returns the metric named by `optimized_metric` so Hydra sweepers can optimise it.
"""

import os
import sys

import hydra
from omegaconf import DictConfig

from gatedprune.train import set_offline_defaults, train


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    try:
        metrics = train(cfg)
    except (ValueError, FileNotFoundError, FloatingPointError) as err:  # bad input, or a run that diverged
        if os.environ.get("GATEDPRUNE_DEBUG"):
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    return float(metrics[cfg.optimized_metric]) if metrics else None  # DDP processes other than rank 0 report nothing


if __name__ == "__main__":
    set_offline_defaults()
    main()
