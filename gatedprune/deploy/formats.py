"""The formats a model ships in, one row each, and the one way to write any of them (``convert``).

A format's module has ``FAMILIES`` (the ``model_type`` values it covers), ``check(model, **options)`` (refuses, in
one line, what its runtime cannot express, before anything is written) and ``write(model, stage, *, tokenizer,
batch, max_new_tokens, **options) -> report`` (writes into ``stage`` and verifies there; raises ``DeployError``).
"""

from __future__ import annotations

import copy
import importlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gatedprune.deploy.extras import require

log = logging.getLogger("gatedprune.export")

REPORT_FILE = "deploy_report.json"


@dataclass(frozen=True)
class Format:
    name: str
    module: str  # imported on use: a format's runtime is an optional extra
    packages: tuple[str, ...]  # what it needs installed (the ``deploy`` extra)
    runtime: str


FORMATS = {f.name: f for f in (
    Format("ct2", "gatedprune.deploy.ct2", ("ctranslate2",), "CTranslate2"),
    Format("onnx", "gatedprune.deploy.onnx_export", ("onnx", "onnxscript", "onnxruntime"), "ONNX Runtime"),
    Format("hf-portable", "gatedprune.deploy.portable", (), "the stock transformers class"),
)}
ALL_FORMATS = ("hf", *FORMATS)  # hf: the verified export itself (gatedprune.shipping.export)


def check_formats(formats, option: str = "--format") -> list[str]:
    """The formats asked for, each one known."""
    formats = [formats] if isinstance(formats, str) else list(formats)
    for fmt in formats:
        if fmt not in ALL_FORMATS:
            raise ValueError(f"{option}={fmt!r} is not a format; allowed: {', '.join(ALL_FORMATS)}")
    return formats


def format_module(fmt: str):
    """The module of ``fmt`` once its packages are there (one line naming the missing extra otherwise)."""
    check_formats([fmt])
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt} is written by the export itself, not converted to")
    require(fmt, FORMATS[fmt].packages)
    return importlib.import_module(FORMATS[fmt].module)


def check_family(model: nn.Module, fmt: str, **options) -> object:
    """The module of ``fmt``, once it covers ``model``'s family and takes ``options`` (before a run trains)."""
    module = format_module(fmt)
    family = model.config.model_type
    if family not in module.FAMILIES:
        raise ValueError(f"--format {fmt} covers {', '.join(module.FAMILIES)}; this model is {family}")
    getattr(module, "check_options", lambda **_: None)(**options)
    return module


def check(model: nn.Module, fmt: str, **options) -> object:
    """The module of ``fmt``, once it has accepted ``model`` (family and shapes): nothing is written before."""
    module = check_family(model, fmt, **options)
    module.check(model, **options)
    return module


def convert(model: nn.Module, out_dir: str | Path, fmt: str, *, tokenizer=None, batch: dict | None = None,
            overwrite: bool = False, max_new_tokens: int = 20, **options) -> dict:
    """Write ``model`` as ``fmt`` to ``out_dir``, verified against ``model`` on ``batch`` (``export.sample_batch``:
    validation pairs, or random ids when None). A failed check leaves no directory. Returns the report, also
    written to ``out_dir/deploy_report.json``."""
    from gatedprune.shipping.export_inputs import sample_batch
    from gatedprune.shipping.export_dir import check_target, staged

    out_dir = Path(out_dir)
    check_target(out_dir, overwrite)
    module = check(model, fmt, **options)
    if any(p.dtype != torch.float32 for p in model.parameters()):  # verified in float32, the caller's model untouched
        model = copy.deepcopy(model).float()
    model.eval()
    batch = batch if batch is not None else sample_batch(model)
    with torch.no_grad(), staged(out_dir, overwrite) as stage:
        report = {"format": fmt, "runtime": FORMATS[fmt].runtime, "family": model.config.model_type,
                  **module.write(model, stage, tokenizer=tokenizer, batch=batch, max_new_tokens=max_new_tokens,
                                 **options)}
        (stage / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    log.info("wrote %s (%s)", out_dir, FORMATS[fmt].runtime)
    return report
