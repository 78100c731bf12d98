"""What a finished run reports: ``metrics.json`` and the final table.

The top-level numbers (``bleu``, ``chrf``, ``val_loss``, ``heads_alive``, ``kept``, ``params``) describe the model a
user ships: the exported, physically pruned model, reloaded from its directory and scored there. Without an export they
are the gated model's under ``pruning.eval_gate_mode``, and ``model`` says so. The gated model's own validation
stays under ``gated``; ``test`` holds the test split of the dense model (end of the dense phase, or the model the
run started from) beside that of the final model, decoded the same way.

``heads_alive`` counts attention heads only (``{"total", kind...}``); ``kept`` and ``kept_total`` count every kind the
model has, ``{kind: n}``: heads, FFN units (``encoder_ffn``, ``decoder_ffn``) and layers (``encoder_layer``,
``decoder_layer``), a head or unit of a dropped layer counted as removed.

``speed`` is the measured speed-up of the shipped model over the dense model (``gatedprune.reports.speed``), or
null when ``report.speed`` is off or nothing was exported; ``export.predicted``, where the exporter gives one, is
the cost model's prediction for ``pruning.workload``.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L

from gatedprune.structures.adapters import attention_sites, probe
from gatedprune.structures.head_gates import PLAN_MODES
from gatedprune.structures.kinds import ALL_KINDS, ATTENTION_KINDS, KINDS, layer_kind
from gatedprune.surgery.record import model_ffn_sites
from gatedprune.versions import versions
from gatedprune.utils import format_table

# the final table's row label of a kind that is not attention heads, by its structure
ROW_LABELS = {"units": "FFN units alive", "layer": "layers alive"}


def budget_objective(metrics: dict, budget: int | None) -> float:
    """BLEU if the run keeps at most ``budget`` heads (or no budget is set), else ``budget - heads kept``.

    The penalised value is negative, so every run over budget ranks below every run within it (BLEU >= 0), and
    among runs over budget the optimiser is pulled towards fewer heads.
    """
    alive = metrics["heads_alive"]["total"]
    return float(metrics["bleu"]) if budget is None or alive <= budget else float(budget - alive)


def heads_kept(export_report: dict) -> dict[str, int]:
    """``{"total", kind...: kept heads}`` of an export report's ``heads_kept`` (``[kept, total]`` pairs)."""
    return {kind: kept for kind, (kept, _) in export_report["heads_kept"].items()}


def heads_in_model(export_report: dict) -> dict[str, int]:
    """``{"total", kind...: heads}`` the unpruned model had, over the kinds the export counts (gated or not), so
    ``heads_alive`` and ``heads_total`` of an exported model count the same heads."""
    return {kind: total for kind, (_, total) in export_report["heads_kept"].items()}


def heads_only(per_kind: dict[str, int]) -> dict[str, int]:
    """``{"total", attention kind...: n}`` of per-kind counts that may also count FFN units and layers."""
    return {kind: n for kind, n in per_kind.items() if kind == "total" or kind in ATTENTION_KINDS}


def exported_structures(export_report: dict) -> tuple[dict[str, int], dict[str, int]]:
    """``({kind: kept}, {kind: before pruning})`` of every kind an export report counts: heads, FFN units and layers
    (reports written before units and layers could go count heads only)."""
    pairs = {kind: pair for field in ("heads_kept", "units_kept", "layers_kept")
             for kind, pair in export_report.get(field, {}).items() if kind != "total"}
    ordered = [kind for kind in ALL_KINDS if kind in pairs]
    return {kind: pairs[kind][0] for kind in ordered}, {kind: pairs[kind][1] for kind in ordered}


def model_structures(model) -> list[tuple[str, int, int]]:
    """``(kind, layer, size)`` of every prunable structure of ``model``: heads of an attention module, units of a
    feed-forward block, 1 for a layer."""
    found = [(s.kind, s.layer, s.num_heads) for s in attention_sites(model)]
    found += [(s.kind, s.layer, s.width) for s in model_ffn_sites(model)]  # none for a mixture of experts
    for stack, path in probe(model).layers.items():
        found += [(layer_kind(stack), i, 1) for i in range(len(model.get_submodule(path)))]
    return found


def gated_structures(gates, model, rule: str = "binary") -> tuple[dict[str, int], dict[str, int]]:
    """``({kind: kept}, {kind: in the model})`` under ``rule`` (the plan mode the gated model is evaluated in), for
    every kind ``model`` has: a gated kind as its gates say (nesting-aware), a kind not gated whole, less what lies
    in a layer the plan drops (the export counts those as removed too)."""
    plan = gates.plan(rule, note=False)
    alive, dropped = gates.alive(plan), gates.dropped(plan)
    kept, total = dict.fromkeys(ALL_KINDS, 0), dict.fromkeys(ALL_KINDS, 0)
    for kind, layer, size in model_structures(model):
        total[kind] += size
        kept[kind] += 0 if (KINDS[kind].stack, layer) in dropped else size
    kept.update({kind: n for kind, n in alive.items() if kind != "total"})
    has = [kind for kind in ALL_KINDS if total[kind]]
    return {kind: kept[kind] for kind in has}, {kind: total[kind] for kind in has}


def export_plan(export_report: dict) -> dict[str, list[int]]:
    """``{attention module path: kept heads}`` of an export report (its plan is grouped by kind)."""
    return {path: kept for per_kind in export_report["plan"].values() for path, kept in per_kind.items()}


def checkpoint_record(checkpoint: str | Path | None, run_dir: str | Path) -> str | None:
    """How ``metrics.json`` names a checkpoint: relative to the run directory when it lies inside it, so that a copy
    of the run names its own file (``gatedprune-export`` reads nothing outside the run it is given); absolute when it
    is another run's (the model a baseline pruned)."""
    if not checkpoint:  # a baseline of a pretrained model: no checkpoint
        return None
    path, run = Path(checkpoint).resolve(), Path(run_dir).resolve()
    return path.relative_to(run).as_posix() if run in path.parents else str(path)


# a cost budget's unit: (what the note calls the budget, what its target is a fraction of)
COST_WORDS = {"params": ("parameter", "non-embedding parameters"), "flops": ("FLOPs", "dense model's FLOPs"),
              "latency": ("latency", "dense model's predicted latency")}


def run_metrics(module, trainer: L.Trainer, final: dict, *, seed: int, checkpoint: str, head_budget: int | None,
                export: dict | None = None, exported: dict | None = None, test: dict | None = None,
                finetuned: dict | None = None, deploy: dict | None = None, speed: dict | None = None) -> dict:
    """metrics.json of a finished run.

    ``final``: the gated model's last validation (Lightning's logged values); ``export``: the exporter's report;
    ``exported``: the exported model's validation score (after fine-tuning, if ``finetuned`` says it was fine-tuned);
    ``test``: ``{"dense": score, "pruned" | "gated": score}``; ``checkpoint``: as ``checkpoint_record`` names it;
    ``speed``: ``measure_speed``'s result for the shipped model, or None (not measured).
    """
    pruning, gates = module.pruning, module.gates
    gated = module.gates_trained  # False for a run that ended before pruning.start_step: a dense baseline
    # the gated column counts the model its BLEU was scored on: the eval mode's plan (log_alpha > 0 for a soft mode)
    rule = module._eval_gate_mode() if module._eval_gate_mode() in PLAN_MODES else "binary"
    kept, in_model = gated_structures(gates, module.model, rule)
    gated_numbers = {
        "bleu": final["val/bleu"], "chrf": final["val/chrf"], "val_loss": final["val/loss"],
        "heads_alive": heads_only(gates.alive(gates.plan(rule, note=False)) if gated else module.heads_total()),
        "kept": kept if gated else in_model,
        "expected_open": final["val/expected_open"], "gate_mode": module._eval_gate_mode(),
    }
    params_before = sum(p.numel() for p in module.model.parameters())
    if exported is not None:
        name = f"exported, fine-tuned {finetuned['steps']} steps ({finetuned['dir']})" if finetuned else "exported"
        kept, in_model = exported_structures(export)
        described = {"model": name, "bleu": exported["bleu"], "chrf": exported["chrf"],
                     "val_loss": exported["loss"], "heads_alive": heads_kept(export), "kept": kept,
                     "params": export["params_after"], "plan": export_plan(export)}
    else:
        described = {"model": f"gated (pruning.eval_gate_mode={gated_numbers['gate_mode']})" if gated else "dense",
                     **{k: gated_numbers[k] for k in ("bleu", "chrf", "val_loss", "heads_alive", "kept")},
                     "params": params_before, "plan": gates.plan()}
    # gated heads; with an export, every head of the model (an ungated kind keeps all of its heads)
    per_kind = heads_in_model(export) if exported is not None else heads_only(module.heads_total())
    metrics = {
        "method": "gated" if gated else "dense",
        **described,
        "heads_total": per_kind["total"],
        "heads_per_kind": per_kind,
        "kept_total": in_model,  # every kind the model has (heads, FFN units, layers), before pruning
        "params_before": params_before,
        "gated": gated_numbers,
        "expected_open": final["val/expected_open"],
        **pruning.describe(module.budget),
        **({} if gated else {"l0_lambda": None}),  # a dense baseline: no lambda was applied
        "budget": module.budget.report() if module.budget is not None else None,
        # where a FLOPs or latency budget's costs came from (gatedprune.costs.build.gate_costs)
        "costs": getattr(module.pruning, "cost_source", None),
        "distill": {
            "alpha": pruning.distill.alpha, "temperature": pruning.distill.temperature, "hidden": pruning.distill.hidden,
            "layer_map": pruning.distill.layer_map,
            "teacher_ms_per_step": sum(module.teacher_ms) / len(module.teacher_ms) if module.teacher_ms else None,
        },
        "convergence": {
            "unconverged_gates": gates.unconverged(), "stop_when_stable": pruning.stop_when_stable,
            "plan_changes": module.plan_changes,
        },
        "checkpoint": checkpoint,
        "dense": module.dense_metrics,
        "test": test or {"note": "no test split: the data source was given none"},
        "steps": trainer.global_step,
        "skipped_steps": module.skipped_steps,
        "sacrebleu_signature": module.signature,
        "seed": seed,
        "versions": versions(),
    }
    if export is not None:
        metrics["export"] = {
            "dir": export["dir"], "rule": export["rule"], "heads_kept": export["heads_kept"],
            "units_kept": export.get("units_kept", {}), "layers_kept": export.get("layers_kept", {}),
            "params": export["params_after"], "verification": export["verification"],
            **({"predicted": export["predicted"]} if export.get("predicted") else {}),  # the cost model's
        }
    metrics["speed"] = speed
    if finetuned is not None:
        metrics["finetune"] = finetuned
    if getattr(module, "converged", None):  # experiment=converge: where the dense training stopped, and why
        metrics["converged"] = module.converged
    if deploy:
        metrics["deploy"] = deploy  # {format: the conversion's report}: where it is, and how it was verified
    metrics["bleu_under_budget"] = budget_objective(metrics, head_budget)
    return metrics


def final_table(metrics: dict) -> str:
    """Dense, gated, exported (and fine-tuned) models side by side: BLEU and chrF (validation, test), heads,
    parameters; for the shipped model, its file size and speed-up over the dense model (``speed_rows``)."""
    test = metrics["test"]
    columns = {}
    if metrics["method"] == "gated" and metrics["dense"]:
        columns[f"dense (step {metrics['dense']['step']})"] = {**metrics["dense"], "test": test.get("dense"),
                                                               "heads_alive": None, "params": metrics["params_before"]}
    reference = metrics.get("reference")
    if reference and reference["test_bleu"] is not None:  # reference=<json>: the same steps, nothing pruned
        columns[f"dense + {reference['steps']} steps"] = {
            "bleu": None, "chrf": None, "test": {"bleu": reference["test_bleu"], "chrf": None}, "heads_alive": None,
            "params": metrics["params_before"]}
    final_test = test.get("pruned") or test.get("gated") if metrics["method"] == "gated" else test.get("dense")
    gated = metrics["gated"]
    name = f"{metrics['method']} (step {metrics['steps']})"
    columns[name] = {**gated, "test": None if "export" in metrics else final_test, "params": metrics["params_before"]}
    if "finetune" in metrics:  # the export as verified, then what fine-tuning made of it
        before = metrics["finetune"]["validation_before"]
        columns["exported"] = {**metrics, **before, "test": test.get("pruned_before_finetune")}
    if "export" in metrics:
        columns["exported + fine-tuned" if "finetune" in metrics else "exported"] = {**metrics, "test": final_test}

    def cell(column: dict, key: str, split: str) -> str:
        source = column if split == "validation" else column["test"]
        return "-" if source is None or source[key] is None else f"{source[key]:.2f}"

    rows = [(f"{split} {label}", *(cell(c, key, split) for c in columns.values()))
            for split in ("validation", "test") for key, label in (("bleu", "BLEU"), ("chrf", "chrF"))]
    for kind, total in metrics["heads_per_kind"].items():
        rows.append((f"heads alive: {kind}", *(f"{(c['heads_alive'] or {}).get(kind, total)} / {total}"
                                               for c in columns.values())))
    for kind, total in metrics.get("kept_total", {}).items():  # FFN units and layers, by stack
        if KINDS[kind].structure in ROW_LABELS:
            rows.append((f"{ROW_LABELS[KINDS[kind].structure]}: {KINDS[kind].stack}",
                         *(f"{(c.get('kept') or {}).get(kind, total)} / {total}" for c in columns.values())))
    rows.append(("parameters", *(f"{c['params']:,}" for c in columns.values())))
    rows += speed_rows(metrics, list(columns))
    table = format_table(["", *columns], rows)
    notes = [f"the top-level numbers of metrics.json describe: {metrics['model']}"]
    if metrics["method"] == "gated":
        costs = [unit for unit in COST_WORDS if metrics.get(f"target_{unit}") is not None]
        target = (f"target {costs[0]} {metrics['target_' + costs[0]]} of the {COST_WORDS[costs[0]][1]}" if costs
                  else f"target heads {metrics['target_heads']}")
        notes.append(f"expected open heads {metrics['expected_open']:.1f}; l0_lambda {metrics['l0_lambda']} "
                     f"({metrics['penalty_normalisation']}); {target}")
    for group, state in (metrics["budget"] or {}).items():
        if "expected_kept" in state:  # a cost budget (CostBudget): fractions of the dense model's cost
            name, what = COST_WORDS[group]
            notes.append(f"{name} budget: target {state['target']:.3g} of the {what}, expected kept at the end "
                         f"{state['expected_kept']:.3g}, by the deterministic gates (log_alpha > 0) "
                         f"{state['binary_kept']:.3g}, by the expected size per kind "
                         f"{state.get('expected_size_kept', float('nan')):.3g}; " + (
                             f"the export ships the eval-mode mask ({state['plan_rule']}), which fits the target"
                             if state.get("plan_rule") in PLAN_MODES else
                             "the export keeps the most open structures that fit the target")
                         + f" ({state['plan_kept']:.3g})")
        else:
            notes.append(f"head budget ({group}): target {state['target']}, expected open heads at the end "
                         f"{state['expected_open']:.1f}; the export keeps exactly the target (top-k)")
    if reference:
        notes.append(reference_note(reference))
    if "note" in test:
        notes.append(test["note"])
    else:
        decoding = next(iter(test.values()))["decoding"]
        notes.append(f"test decoding: {decoding['num_beams']} beam(s), at most {decoding['max_new_tokens']} new tokens")
    checkpoint = metrics["checkpoint"]  # relative: to the run directory (absolute in runs written before)
    where = "" if checkpoint is None or Path(checkpoint).is_absolute() else " (in the run directory)"
    notes += [f"checkpoint: {checkpoint}{where}", f"sacreBLEU: {metrics['sacrebleu_signature']['bleu']}"]
    if "export" in metrics:
        check = metrics["export"]["verification"]
        notes.append(f"pruned model: {metrics['export']['dir']} (max |logit diff| vs gated "
                     f"{check['max_abs_logit_diff']:.1e}, greedy identical: {check['greedy_identical']})")
        if metrics.get("speed"):
            notes.append(speed_note(metrics["speed"]))
    return table + "\n" + "\n".join(notes)


def reference_note(reference: dict) -> str:
    """Where the fair reference's column comes from, or why there is none."""
    if reference["test_bleu"] is None:
        return (f"reference: {reference['path']} has no test BLEU at this run's {reference['steps']} steps (it has "
                f"{', '.join(map(str, reference['measured_at']))}): no column for it")
    return (f"dense + {reference['steps']} steps: the starting model trained on as long, nothing pruned "
            f"({reference['path']})")


def speed_rows(metrics: dict, columns: list[str]) -> list[tuple]:
    """The final table's speed rows: file size, and the shipped model's (last column) speed-up over the dense model,
    measured (wall, CPU; one cell per batch size, e.g. "1.52x / 1.61x") and predicted where the cost model gave one.
    No rows without an export: there is no shipped model to time."""
    if "export" not in metrics:
        return []
    speed, predicted = metrics.get("speed"), metrics["export"].get("predicted")

    def row(label: str, shipped: str, dense: str = "-") -> tuple:
        first = [dense if name.startswith("dense") else "-" for name in columns[:-1]]
        return (label, *first, shipped)

    rows = []
    if speed:
        sizes = speed["file_bytes"]
        rows.append(row("safetensors MiB", f"{sizes['pruned'] / 2**20:.2f}", f"{sizes['dense'] / 2**20:.2f}"))
        batches = speed["batches"]
        label = " / ".join(batches)
        for name, key in (("wall", "speed_up"), ("CPU", "cpu_speed_up")):
            cells = " / ".join("-" if b[key] is None else f"{b[key]:.2f}x" for b in batches.values())
            rows.append(row(f"speed-up measured, {name} (batch {label})", cells))
    else:
        rows.append(row("speed-up measured", "not measured (report.speed=false)"))
    if predicted and predicted.get("speed_up") is not None:
        rows.append(row("speed-up predicted (pruning.workload)", f"{predicted['speed_up']:.2f}x"))
    return rows


def speed_note(speed: dict) -> str:
    """How the speed-up (``metrics["speed"]``) was measured, with the times behind it, in one line."""
    w = speed["workload"]
    times = "; ".join(f"batch {b}: dense {t['dense_ms']:.1f} ms, shipped {t['pruned_ms']:.1f} ms wall "
                      f"({t['dense_cpu_ms']:.1f} / {t['pruned_cpu_ms']:.1f} ms CPU)"
                      for b, t in speed["batches"].items())
    return (f"speed-up: shipped model over the dense model, {w['decoding']}, {w['source_tokens']} random source "
            f"tokens, exactly {w['new_tokens']} new tokens, {w['device']} {w['dtype']}, {w['threads']} torch "
            f"thread(s), timed alternately, median of {w['repeats']}: {times}")
