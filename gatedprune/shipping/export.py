"""Finalise a gated model: gates -> plan -> pruned copy -> verified against the gated model -> export directory.

``export_gated`` does it for a model in memory, ``export_checkpoint`` for a run directory or checkpoint (what
``gatedprune-export`` runs). What the directory holds and how it is written: ``gatedprune.shipping.export_dir``.
"""

from __future__ import annotations

import copy
import logging
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch import nn

from gatedprune.shipping import export_dir
from gatedprune.shipping.export_inputs import Pairs, check_counts, check_device, file_record, find_run_files, read_pairs
from gatedprune.shipping.export_inputs import sample_batch  # noqa: F401  (API: the verification batch)
from gatedprune.training.checkpoints import load_gated_checkpoint
from gatedprune.errors import RunFailed
from gatedprune.shipping.export_dir import MODELING_FILE, REPORT_FILE, check_out_dir, save_pruned  # noqa: F401  (API)
from gatedprune.structures.head_gates import RULES, HeadGates
from gatedprune.surgery.model_loading import auto_class, fresh_model, load_pruned
from gatedprune.surgery.cut import count_parameters, prune_heads, removed_parameters
from gatedprune.structures.masking import masked_heads
from gatedprune.utils import check_numbers

log = logging.getLogger("gatedprune.export")  # the name users configure logging by, wherever the module lives

TOLERANCE = 1e-4  # largest |logit difference| (float32) allowed between the gated and the pruned model


@dataclass
class ExportConfig:
    """``export.*``: what ``train.py`` ships at the end of a run (``conf/export/default.yaml`` holds the defaults)."""

    enabled: bool = True
    rule: str = "binary"  # binary: keep heads with log_alpha > 0; top-k: keep the top_k heads by log_alpha
    top_k: int | None = None
    samples: int = 32  # validation pairs the export verifies on
    out_dir: str = "pruned"
    formats: tuple = ("hf",)  # also ct2, onnx, hf-portable: the shipped model converted (gatedprune.deploy)
    quantization: str | None = None  # ct2: int8, float16, ... (float32 when null)
    deploy_dir: str = "deploy"  # <deploy_dir>/<format>/ for each format besides hf

    def __post_init__(self) -> None:
        check_numbers("export", self)
        from gatedprune.deploy.formats import FORMATS, check_formats, format_module

        self.formats = tuple(check_formats(self.formats, "export.formats"))
        if "hf" not in self.formats:
            raise ValueError(f"export.formats={list(self.formats)} leaves out hf; allowed: hf and any of "
                             f"{', '.join(FORMATS)} (the others are converted from the verified hf export)")
        for fmt in self.deploy_formats():
            format_module(fmt)  # a missing extra is refused now, not after training
        if self.quantization is not None and "ct2" not in self.formats:
            raise ValueError(f"export.quantization={self.quantization} without ct2 in export.formats; allowed: null")
        if "ct2" in self.formats:
            format_module("ct2").check_options(quantization=self.quantization)

    def check_model(self, model: nn.Module) -> None:
        """Each format asked for covers the model's family: refused before training, not after."""
        from gatedprune.deploy.formats import check_family

        for fmt in self.deploy_formats():
            check_family(model, fmt)

    def deploy_formats(self) -> list[str]:
        return [fmt for fmt in self.formats if fmt != "hf"]

    def check_rule(self) -> None:
        """``rule`` and ``top_k`` fit together (the gated methods' export; the others keep their own levels)."""
        if self.rule not in RULES:
            raise ValueError(f"export.rule={self.rule!r}; allowed: {', '.join(RULES)}")
        if (self.rule == "top-k") != (self.top_k is not None):
            raise ValueError(f"export.rule={self.rule} with export.top_k={self.top_k}; allowed: top_k (a head count) "
                             "with rule top-k only")


class ExportError(RunFailed):
    """The pruned model does not compute what the gated model computes; the message carries the numbers."""


# --- gates -> plan --------------------------------------------------------------------------------------------


def _rule_name(rule: str, top_k: int | dict | None) -> str:
    if rule == "params":
        return f"params, at most {top_k:,} prunable parameters kept"
    if rule == "flops":
        return f"flops, at most {top_k:.4g} prunable FLOPs kept"
    if rule == "latency":  # a latency fit's unit: seconds per generate() call
        return f"latency, at most {top_k:.4g} s of prunable latency kept"
    if rule == "expected_size":  # a cost budget's export_fill=false: the gated model's eval-mode mask, within budget
        return "expected_size (CoFiPruning's deterministic mask: per kind the expected number of open gates)"
    return "binary" if rule == "binary" else f"top-k, k={top_k}"


# --- verification inputs and outputs -------------------------------------------------------------------------


@torch.no_grad()
def _logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    device = next(model.parameters()).device
    return model(**{name: value.to(device) for name, value in batch.items()}).logits.float()  # (B, T, V)


@torch.no_grad()
def _greedy(model: nn.Module, batch: dict[str, torch.Tensor], max_new_tokens: int) -> torch.Tensor:
    device = next(model.parameters()).device
    return model.generate(
        input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
        max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
    ).cpu()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.cpu() - b.cpu()).abs().max())


@contextmanager
def _full_float32(device_type: str) -> Iterator[None]:
    """True float32 matmuls (no TF32) and no autocast, whatever the trainer set, for the 1e-4 comparison."""
    precision, cudnn_tf32 = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.autocast(device_type, enabled=False):
            yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32


def _float32_copy(model: transformers.PreTrainedModel, device: torch.device | str | None) -> nn.Module:
    """A float32 copy of ``model`` without its gate hooks (a fresh instance, so no hook comes along)."""
    clone = fresh_model(copy.deepcopy(model.config))
    clone.load_state_dict(model.state_dict())
    clone.generation_config = copy.deepcopy(model.generation_config)
    return clone.to(device=device or next(model.parameters()).device, dtype=torch.float32).eval()


def dense_copy(model: transformers.PreTrainedModel) -> nn.Module:
    """The gated model with every structure and no gates: what it was before pruning, on the CPU in float32."""
    return _float32_copy(model, "cpu")


# --- writing the directory -----------------------------------------------------------------------------------


# --- the exporter --------------------------------------------------------------------------------------------


def export_gated(
    model: transformers.PreTrainedModel,
    gates: HeadGates,
    out_dir: str | Path,
    tokenizer=None,
    rule: str = "binary",
    top_k: int | None = None,
    sample_inputs: Mapping[str, torch.Tensor] | Pairs | None = None,
    overwrite: bool = False,
    *,
    max_new_tokens: int = 20,
    device: torch.device | str | None = "cpu",
    checkpoint: dict | None = None,
) -> dict:
    """Prune a copy of the gated ``model`` by the gate rule, verify it, and write the export directory.

    The caller's model and gates are left as they are. Verification (float32, on ``sample_inputs``: a batch of
    tensors or (source, target) text pairs; random ids when None): the pruned model's logits within 1e-4 of the
    gated model with gates fixed to the plan, identical greedy generations, both reloading paths giving the
    in-memory pruned model's logits, and the parameter count down by exactly the removed structures' parameters.
    Raises ``ExportError`` with the numbers (and writes nothing) if any check fails; returns the report.
    ``device`` runs the verification (None: the model's device); the exported weights are the same either way.
    ``checkpoint``: the file the gated model was read from (``file_record``), kept in the report.
    """
    out_dir = Path(out_dir)
    export_dir.check_target(out_dir, overwrite)  # fail before the expensive part
    plan = gates.plan(rule, top_k)
    rule_name = _rule_name(rule, top_k)
    unconverged = gates.unconverged()
    if unconverged:
        log.warning(
            "gates have not converged: %d of %d deterministic gates lie strictly between 0 and 1",
            unconverged, gates.num_gates,
        )
    alive, gated = gates.alive(plan), gates.heads_per_kind()
    log.info("rule %s keeps %s", rule_name, ", ".join(f"{kind} {alive[kind]}/{gated[kind]}" for kind in gated))
    binary = gates.plan(note=False)
    decided = gates.differences(plan, binary)  # where the rule overrode log_alpha > 0
    if rule != "binary":
        log.info("rule %s decided %d structures differently from the binary rule (log_alpha > 0)", rule_name, decided)

    save_dtype = next(model.parameters()).dtype
    work = _float32_copy(model, device)
    batch = sample_batch(work, tokenizer, sample_inputs)
    inputs = (
        f"{len(batch['input_ids'])} random input sequences" if sample_inputs is None
        else f"{len(batch['input_ids'])} validation samples"
    )
    on = next(work.parameters()).device
    with _full_float32(on.type), export_dir.staged(out_dir, overwrite) as stage:
        with masked_heads(work, plan):
            gated_logits, gated_tokens = _logits(work, batch), _greedy(work, batch, max_new_tokens)
        params_before = count_parameters(work)
        params_removed = removed_parameters(work, plan)
        dense_costs = {unit: c.linear.of(work) for unit, c in gates.costs.items() if c.linear is not None}
        work.save_pretrained(stage / "unpruned")
        size_before = export_dir.weights_size(stage / "unpruned")
        shutil.rmtree(stage / "unpruned")

        prune_heads(work, plan, rule=rule_name)
        pruned_logits, pruned_tokens = _logits(work, batch), _greedy(work, batch, max_new_tokens)
        export_dir.write_model(work.to(save_dtype), stage, tokenizer)
        reload_options = {"dtype": torch.float32, "attn_implementation": work.config._attn_implementation}
        reloaded = {
            "load_pruned": load_pruned(stage, **reload_options),
            "trust_remote_code": auto_class(work.config).from_pretrained(
                stage, trust_remote_code=True, **reload_options
            ),
        }
        reload_diffs = {way: _max_diff(_logits(m.to(on), batch), pruned_logits) for way, m in reloaded.items()}
        check = {
            "inputs": inputs,
            "max_abs_logit_diff": _max_diff(gated_logits, pruned_logits),
            "tolerance": TOLERANCE,
            "greedy_identical": bool(torch.equal(gated_tokens, pruned_tokens)),
            "greedy_sequences": len(gated_tokens),
            "max_new_tokens": max_new_tokens,
            "reload_max_abs_logit_diff": reload_diffs,
            "params_match": count_parameters(work) == params_before - params_removed,
        }
        check["passed"] = (
            check["max_abs_logit_diff"] < TOLERANCE
            and check["greedy_identical"]
            and all(diff < TOLERANCE for diff in reload_diffs.values())
            and check["params_match"]
        )
        budget = _params_budget(gates, rule, top_k, params_removed)
        predicted = _predicted(gates, dense_costs, work, params_removed)
        report = {
            **export_dir.describe(work, stage, size_before), "unconverged_gates": unconverged, "decided_by_rule": decided,
            **({"params_budget": budget} if budget else {}), "predicted": predicted,
            "verification": check, **({"checkpoint": checkpoint} if checkpoint else {}),
        }
        log.info("%s", _verification_summary(report))
        if not check["passed"]:
            raise ExportError(
                f"verification failed, nothing written to {out_dir}:\n{_verification_summary(report)}\n"
                f"parameters: before {params_before}, removed heads' {params_removed}, "
                f"after {report['params_after']} (expected {params_before - params_removed})"
            )
        export_dir.write_card(stage, work, report)
    log.info("wrote %s", out_dir)
    return report


def _params_budget(gates: HeadGates, rule: str, allowed, removed: int) -> dict | None:
    """How close the parameter rule came to its budget (logged, and kept in the report)."""
    if rule != "params":
        return None
    total = gates.non_embedding_params
    budget = {"prunable_kept": gates.prunable_params - removed, "prunable_allowed": allowed,
              "non_embedding_kept_fraction": (total - removed) / total}
    log.info("parameter budget: %s of at most %s prunable parameters kept; %.4f of the non-embedding parameters",
             f"{budget['prunable_kept']:,}", f"{allowed:,}", budget["non_embedding_kept_fraction"])
    return budget


def _predicted(gates: HeadGates, dense_costs: dict[str, float], pruned: nn.Module, removed: int) -> dict:
    """The pruned model's cost as a fraction of the dense model's, in every unit the gates were costed in
    (``gatedprune.costs``: parameters always; FLOPs and latency under a budget in them), and the speed-up the
    latency fit predicts."""
    total = gates.non_embedding_params
    predicted = {"params": (total - removed) / total}
    for unit, dense in dense_costs.items():
        predicted[unit] = gates.costs[unit].linear.of(pruned) / dense
    if "latency" in predicted:
        predicted["speed_up"] = 1 / predicted["latency"]
    return predicted


def _verification_summary(report: dict) -> str:
    check = report["verification"]
    kept, total = report["heads_kept"]["total"]
    others = {**report.get("units_kept", {}), **report.get("layers_kept", {})}
    return "\n".join([
        f"heads kept {kept}/{total} ("
        + ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in report["heads_kept"].items() if k != "total") + ")"
        + "".join(f"; {k} {v[0]}/{v[1]}" for k, v in others.items() if v[0] != v[1]),
        f"parameters {report['params_before']:,} -> {report['params_after']:,}; weights file "
        f"{export_dir.megabytes(report['file_size_before'])} -> {export_dir.megabytes(report['file_size_after'])}",
        f"verification on {check['inputs']}: max |logit diff| gated vs pruned {check['max_abs_logit_diff']:.3g} "
        f"(tolerance {check['tolerance']:g}); greedy identical: {check['greedy_identical']}; "
        f"reloaded max |logit diff|: {export_dir.reload_diffs(check)}; parameter count exact: {check['params_match']}",
    ])


# --- from a training run -------------------------------------------------------------------------------------


def export_checkpoint(
    source: str | Path,
    out_dir: str | Path,
    *,
    rule: str = "binary",
    top_k: int | None = None,
    overwrite: bool = False,
    samples: int = 8,
    val_pairs: str | Path | None = None,
    max_new_tokens: int = 20,
    device: str | None = "cpu",
) -> dict:
    """``export_gated`` for a run directory or a Lightning checkpoint; tokenizer and val_pairs.jsonl from the run."""
    check_device(device)
    check_counts(samples, max_new_tokens)
    checkpoint, run_dir = find_run_files(Path(source))
    check_out_dir(Path(out_dir), protected=[checkpoint, *([run_dir] if run_dir else [])], run_dir=run_dir)
    model, gates = load_gated_checkpoint(checkpoint)
    read = file_record(checkpoint)
    log.info("read checkpoint %s (sha256 %s)", checkpoint, read["sha256"])
    tokenizer = None
    if run_dir is not None and (run_dir / "tokenizer").is_dir():
        tokenizer = transformers.AutoTokenizer.from_pretrained(run_dir / "tokenizer")
    else:
        log.warning("no tokenizer/ beside %s: the export will hold no tokenizer", checkpoint)
    if val_pairs is None and run_dir is not None and (run_dir / "val_pairs.jsonl").exists():
        val_pairs = run_dir / "val_pairs.jsonl"
    pairs = read_pairs(Path(val_pairs), samples) if val_pairs is not None and tokenizer is not None else None
    return export_gated(
        model, gates, out_dir, tokenizer, rule=rule, top_k=top_k, sample_inputs=pairs, overwrite=overwrite,
        max_new_tokens=max_new_tokens, device=device, checkpoint=read,
    )
