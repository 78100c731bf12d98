"""``gatedprune-evaluate``: score a seq2seq model directory on a split (BLEU, chrF, loss, speed).

The trainer scores validation, the dense model and the exported model with it; ``gatedprune-evaluate`` scores any
Hugging Face seq2seq directory, pruned by gatedprune or not, on a split of any data source the trainer accepts:

    gatedprune-evaluate MODEL_DIR [--split test] [--num-beams N] [--batch-size N] [data overrides ...]

e.g. ``gatedprune-evaluate outputs/<date>/<time>/pruned --num-beams 4`` (the Bible test split) or
``gatedprune-evaluate my-model data=files data.files.train=train.tsv data.files.validation=dev.tsv
data.files.test=test.tsv``. A model directory inside a run (its export, ``<run>/pruned``) is scored on the run's
data (``train_config``). It prints a table and writes ``eval.json`` (``--out``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from gatedprune.reports.scoring import GenerationConfig, score
from gatedprune.surgery.model_loading import load_seq2seq


RUN_RECORD = ".hydra"  # where Hydra records a run's config (config.yaml) and its command line (overrides.yaml)


def run_of(path: str | Path) -> Path | None:
    """The run directory ``path`` is, or lies in (a gated run's export ``<run>/pruned``, a baseline's level export
    ``<run>/levels/<n>_heads/pruned``): the nearest of ``path`` and its ancestors that holds Hydra's record of a
    run's config; None for a directory outside any run."""
    path = Path(path)
    if not path.is_dir():
        return None
    return next((d for d in (path, *path.resolve().parents) if (d / RUN_RECORD / "config.yaml").is_file()), None)


def train_config(model_dir: str | Path, overrides: Sequence[str] = ()):
    """The trainer's config that names the data (and test decoding) for the model in ``model_dir``.

    A run directory, or a model directory inside one (its export), is scored on its run's data: the config the
    run recorded, or, with ``overrides``, the run's own command line (``.hydra/overrides.yaml``) followed by them.
    Any other model: the trainer's defaults with ``overrides``. Splits of ``data=files`` left unset are None.
    """
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    from gatedprune.errors import one_line
    from gatedprune.training.rundir import recorded_command

    run = run_of(model_dir)
    if run is not None and not overrides:
        cfg = OmegaConf.load(run / RUN_RECORD / "config.yaml")
        # recorded as ${hydra:runtime.output_dir}, which only resolves inside a running Hydra app
        OmegaConf.update(cfg, "paths.output_dir", str(run), force_add=True)
    else:
        before = recorded_command(run) if run is not None else []  # its group choices, then its own command line
        try:
            with initialize_config_module("gatedprune.conf", version_base="1.3"):
                cfg = compose("train", overrides=[*before, *overrides, "paths.output_dir=."])
        except HydraException as err:  # a mistyped override: the trainer's one-line wording
            cause = f": {one_line(str(err.__cause__))}" if err.__cause__ is not None else ""
            raise ValueError(one_line(str(err)) + cause) from None
    files = cfg.data.get("files")
    for name in list(files or {}):  # data=files: the splits not given are not needed here
        if OmegaConf.is_missing(files, name):
            files[name] = None
    return cfg


def split_data(cfg, tokenizer_path: str | Path, split: str, model=None):
    """The data module of ``cfg.data``, set up with the tokenizer at ``tokenizer_path``; it must have ``split`` (the
    source's other splits come along where it has them). Pairs longer than ``model``'s positions are cut to them."""
    from hydra.utils import instantiate

    if split not in ("train", "validation", "test"):
        raise ValueError(f"--split {split!r}; allowed: train, validation, test")
    data = instantiate(cfg.data, tokenizer_path=str(tokenizer_path), required_splits=[split], _convert_="all")
    if model is not None:
        data.limit_positions(model)
    data.setup("test")
    if split not in data.datasets:
        raise ValueError(f"data source {data.source!r} has no {split!r} split; give one (e.g. data.files.{split}=...)")
    return data


def evaluate_dir(model_dir: str | Path, split: str = "test", overrides: Sequence[str] = (),
                 num_beams: int | None = None, batch_size: int | None = None) -> dict:
    """Score the model in ``model_dir`` on ``split`` of its data (``train_config``: its run's, or the trainer's
    defaults with ``overrides``).

    The model's own tokenizer (in ``model_dir``) tokenises the data; decoding is the trainer's test decoding
    (``test_generation``), with ``num_beams`` and ``batch_size`` if given.
    """
    from hydra.utils import instantiate

    # refused here, before any data or model loads: 0 used to fall back to the default without a word
    for option, value in (("--num-beams", num_beams), ("--batch-size", batch_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{option} {value}; allowed: an integer >= 1 (or leave it out for the default)")
    cfg = train_config(model_dir, overrides)
    gen = instantiate(cfg.test_generation, _convert_="all")
    if num_beams is not None or batch_size is not None:
        gen = GenerationConfig(**{**asdict(gen), **({"num_beams": num_beams} if num_beams is not None else {}),
                                  **({"batch_size": batch_size} if batch_size is not None else {})})
    if split not in ("train", "validation", "test"):
        raise ValueError(f"--split {split!r}; allowed: train, validation, test")
    model = load_seq2seq(model_dir)
    data = split_data(cfg, model_dir, split, model)  # the model's own tokenizer
    result = score(model, data.tokenizer, data.loader(split, gen.batch_size, shard=False), gen)
    return {"model": str(model_dir), "split": split, "data": data.describe(), **result}


if __name__ == "__main__":  # python -m gatedprune.reports.evaluate (the command's own module): the command, as documented
    import sys

    from gatedprune.cli import evaluate_command

    sys.exit(evaluate_command())
