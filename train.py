"""Entry point: `python train.py [overrides]`, e.g. `python train.py experiment=smoke pruning.l0_lambda=0.05`.

Returns the metric named by `optimized_metric` so Hydra sweepers can optimise it.
"""

import hydra
from omegaconf import DictConfig

from gatedprune.cli import reported_errors, run_hydra_app
from gatedprune.train import set_offline_defaults, train


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    with reported_errors():  # bad input: `error: ...`, exit 2; a run that diverged or did not verify: exit 1
        metrics = train(cfg)
    return float(metrics[cfg.optimized_metric]) if metrics else None  # DDP processes other than rank 0 report nothing


if __name__ == "__main__":
    set_offline_defaults()
    run_hydra_app(main)
