"""Reports by kind (issue 23): one smoke run with every kind gated under a parameter budget, checked in
metrics.json, the final table, the sweep summary, the gate heatmaps and the head report against its export's own
record; the head report of a model whose layers were dropped against the same model with those layers gated shut."""

import copy
import csv
import io
import json
import re

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
import transformers

from helpers import run_train
from gatedprune.cli import analyze_command
from gatedprune.reports.analysis import attention_measures, original_layers, report_modules
from gatedprune.reports.plots import head_heatmap
from gatedprune.reports.sweep import summarise
from gatedprune.structures.adapters import attention_sites
from gatedprune.structures.kinds import ALL_KINDS, KINDS
from gatedprune.structures.masking import masked_heads
from gatedprune.surgery.cut import prune_heads
from gatedprune.data import collate_pairs

EVERY_KIND = "pruning.kinds=[encoder,decoder,cross,encoder_ffn,decoder_ffn,encoder_layer,decoder_layer]"
# half the non-embedding parameters: on the smoke model this keeps heads in both stacks and drops some units (and,
# as trained today, encoder layer 0); the assertions below hold whatever the gates decide
BUDGET = ("pruning=l0_budget", "pruning.target_params=0.5", "pruning.target_warmup_steps=20", "pruning.gate_lr=0.5",
          "trainer.max_steps=60")
PAIRS = 16
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run directory, its printed output, metrics.json, the export report and the export's plan record."""
    run_dir = tmp_path_factory.mktemp("kinds") / "sweep" / "0"
    run_dir.parent.mkdir(parents=True)
    proc = run_train(run_dir, EVERY_KIND, *BUDGET)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    report = json.loads((run_dir / "pruned" / "export_report.json").read_text())
    record = json.loads((run_dir / "pruned" / "config.json").read_text())["gatedprune"]
    return run_dir, proc.stdout, metrics, report, record


def _pairs(report: dict) -> dict[str, list[int]]:
    """``{kind: [kept, total]}`` of every kind the export report counts."""
    return {k: v for field in ("heads_kept", "units_kept", "layers_kept") for k, v in report[field].items()
            if k != "total"}


def test_metrics_give_every_kind_as_the_export_counts_it(run):
    _, _, metrics, report, _ = run
    pairs = _pairs(report)
    assert set(pairs) == set(ALL_KINDS)  # the smoke model has every kind
    assert metrics["kept"] == {k: kept for k, (kept, _) in pairs.items()}
    assert metrics["kept_total"] == {k: total for k, (_, total) in pairs.items()}
    # the smoke model: 2 + 2 layers of 4 heads and 64 units each
    assert metrics["kept_total"] == {"encoder": 8, "decoder": 8, "cross": 8, "encoder_ffn": 128, "decoder_ffn": 128,
                                     "encoder_layer": 2, "decoder_layer": 2}
    assert metrics["heads_alive"] == {"total": sum(metrics["kept"][k] for k in ("encoder", "decoder", "cross")),
                                      **{k: metrics["kept"][k] for k in ("encoder", "decoder", "cross")}}
    assert metrics["heads_per_kind"] == {"total": 24, "encoder": 8, "decoder": 8, "cross": 8}
    assert set(metrics["gated"]["heads_alive"]) == {"total", "encoder", "decoder", "cross"}  # heads only
    assert metrics["params"] == report["params_after"] < metrics["params_before"]
    assert metrics["target_params"] == 0.5 and metrics["budget"]["params"]["target"] == 0.5
    assert metrics["export"]["units_kept"] == report["units_kept"]
    assert metrics["export"]["layers_kept"] == report["layers_kept"]


def test_the_gated_column_counts_what_the_binary_rule_keeps_inside_open_layers(run):
    run_dir, _, metrics, _, _ = run
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    layout = state["state_dict"]["gates._extra_state"]
    log_alpha = [state["state_dict"][f"gates.gates.{i}.log_alpha"] for i in range(len(layout["paths"]))]
    layer_open = {}
    for kind, layer, values in zip(layout["kinds"], layout["layers"], log_alpha):
        if KINDS[kind].structure == "layer":
            layer_open[(KINDS[kind].stack, layer)] = bool(values[0] > 0)
    decoder = [key for key in layer_open if key[0] == "decoder"]
    if not any(layer_open[key] for key in decoder):  # a decoder keeps its most open layer
        best = max(decoder, key=lambda key: next(v for k, la, v in zip(layout["kinds"], layout["layers"], log_alpha)
                                                 if k == "decoder_layer" and la == key[1]).item())
        layer_open[best] = True
    expected = dict.fromkeys(ALL_KINDS, 0)
    for kind, layer, values in zip(layout["kinds"], layout["layers"], log_alpha):
        inside = layer_open.get((KINDS[kind].stack, layer), True)
        expected[kind] += int((values > 0).sum()) * inside if KINDS[kind].structure != "layer" else int(inside)
    assert metrics["gated"]["kept"] == expected


def test_the_final_table_has_a_row_per_stack_for_units_and_layers(run):
    run_dir, out, metrics, report, _ = run
    table = out[out.index("dense (step"):]
    rows = {label.strip(): re.split(r"\s{2,}", cells.strip()) for label, cells in
            (re.match(r"(\S.*?:\s\w+)\s{2,}(.*)", line).groups() for line in table.splitlines()
             if re.match(r"(FFN units|layers|heads) alive: ", line))}
    pairs = _pairs(report)
    for kind in ALL_KINDS:
        spec = KINDS[kind]
        label = {"heads": f"heads alive: {kind}", "units": f"FFN units alive: {spec.stack}",
                 "layer": f"layers alive: {spec.stack}"}[spec.structure]
        kept, total = pairs[kind]
        dense, gated, exported = rows[label]
        assert dense == f"{total} / {total}" and exported == f"{kept} / {total}", label
        assert gated == f"{metrics['gated']['kept'][kind]} / {total}", label
    labels = [line.split("  ")[0] for line in table.splitlines()]
    assert labels.index("heads alive: cross") < labels.index("FFN units alive: encoder") < labels.index(
        "layers alive: decoder") < labels.index("parameters")
    budget = metrics["budget"]["params"]
    assert (f"parameter budget: target 0.5 of the non-embedding parameters, expected kept at the end "
            f"{budget['expected_kept']:.3g}, by the deterministic gates (log_alpha > 0) {budget['binary_kept']:.3g}, "
            f"by the expected size per kind {budget['expected_size_kept']:.3g}; the export keeps the most open "
            f"structures that fit the target ({budget['plan_kept']:.3g})" in table)
    assert budget["plan_kept"] == pytest.approx(report["predicted"]["params"])  # the export's own count
    # logged at every gated validation, the last one the same as metrics.json's
    rows = [row for row in csv.DictReader(io.StringIO((run_dir / "csv" / "metrics.csv").read_text()))
            if row.get("val/budget_params_binary_kept")]
    assert rows and float(rows[-1]["val/budget_params_binary_kept"]) == pytest.approx(budget["binary_kept"])
    assert "target params 0.5 of the non-embedding parameters" in table


def test_the_sweep_summary_has_units_and_layers_per_stack_and_a_parameter_plot(run, tmp_path):
    run_dir, _, metrics, report, _ = run
    old = run_dir.parent / "1"  # a run written before metrics.json counted units and layers
    old.mkdir(exist_ok=True)
    (old / "metrics.json").write_text(json.dumps({k: v for k, v in metrics.items() if k not in ("kept", "kept_total")}))
    summarise(run_dir.parent, tmp_path)
    with open(tmp_path / "summary.csv", newline="") as f:
        rows = {r["run"]: r for r in csv.DictReader(f)}
    pairs = _pairs(report)
    new = rows["0"]
    assert (new["units_encoder"], new["units_decoder"]) == (str(pairs["encoder_ffn"][0]), str(pairs["decoder_ffn"][0]))
    assert (new["layers_encoder"], new["layers_decoder"]) == (str(pairs["encoder_layer"][0]),
                                                              str(pairs["decoder_layer"][0]))
    assert new["params"] == str(report["params_after"])
    assert all(rows["1"][c] == "" for c in ("units_encoder", "units_decoder", "layers_encoder", "layers_decoder"))
    md = (tmp_path / "summary.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| run "))
    assert "| heads alive | encoder_ffn | decoder_ffn | encoder_layer | decoder_layer | BLEU |" in header
    for name in ("pareto.png", "pareto_params.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG


def test_gate_heatmaps_are_written_with_every_kind(run):
    run_dir = run[0]
    pictures = sorted(p.name for p in (run_dir / "gates").glob("step_*.png"))
    assert pictures[-1] == "step_0000060.png"
    assert all((run_dir / "gates" / p).read_bytes()[:8] == PNG for p in pictures)


def test_a_wide_ffn_panel_keeps_a_fixed_width_and_counts_kept_units_per_layer():
    # 2048 units beside 8 heads: the FFN panel is a few head panels wide, not 256; a layer panel is one column
    rng = np.random.default_rng(0)
    widths = {"encoder": 8, "encoder_ffn": 2048, "encoder_layer": 1}
    panels = {k: [(layer, rng.random(w).tolist()) for layer in range(3)] for k, w in widths.items()}
    marks = {k: [(layer, [v < 0.5 for v in values]) for layer, values in rows] for k, rows in panels.items()}
    fig = head_heatmap(panels, label="P(open)", vmin=0, vmax=1, marks=marks)
    heads, ffn, layer = fig.axes[:3]
    ratio = ffn.get_position().width / heads.get_position().width
    assert 1 < ratio < 3
    assert layer.get_xticks().size == 0 and ffn.get_xlabel() == "unit" and heads.get_xlabel() == "head"
    labels = [t.get_text() for t in ffn.get_yticklabels()]
    assert labels == [f"{layer} ({sum(not m for m in row)}/2048)" for layer, row in marks["encoder_ffn"]]
    assert not ffn.collections and heads.collections and layer.collections  # crosses: not on 2048 units
    fig.savefig(io.BytesIO(), format="png")  # and it draws
    plt.close(fig)


def test_the_head_report_of_the_export_numbers_layers_as_the_unpruned_model(run, tmp_path):
    run_dir, _, _, _, record = run
    out = tmp_path / "analysis"
    assert analyze_command([str(run_dir / "pruned"), "--max-pairs", str(PAIRS), "--out", str(out)]) == 0
    with open(out / "heads.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    # the record's paths are the layers as they are now; kept_layers gives each one's original number
    expected = set()
    for kind, per_path in record["kept_heads"].items():
        stack = KINDS[kind].stack
        for path, heads in per_path.items():
            now = int(path.split(".layers.")[1].split(".")[0])
            expected |= {(path, kind, record["kept_layers"][stack][now], h) for h in heads}
    assert {(r["path"], r["kind"], int(r["layer"]), int(r["head"])) for r in rows} == expected
    dropped = {(stack, e["layer"]) for stack, entries in record["dropped"].items() for e in entries}
    assert not {(KINDS[r["kind"]].stack, int(r["layer"])) for r in rows} & dropped  # no head of a dropped layer
    md = (out / "heads.md").read_text()
    for stack, layer in dropped:
        assert re.search(rf"{stack} layers? [\d, ]*\b{layer}\b", md), md[:600]
    assert (out / "heatmap_importance.png").read_bytes()[:8] == PNG


@pytest.fixture(scope="module")
def dropped_layers():
    """A tiny mBART and a plan that drops layer 0 of both stacks, cuts FFN units and heads of layer 1."""
    torch.manual_seed(0)
    config = transformers.MBartConfig(
        vocab_size=40, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=16, decoder_ffn_dim=16, max_position_embeddings=32, init_std=0.5,
        pad_token_id=1, eos_token_id=2, bos_token_id=0, decoder_start_token_id=2, attn_implementation="eager",
    )
    model = transformers.MBartForConditionalGeneration(config).eval()
    plan = {"model.encoder.layers": [1], "model.decoder.layers": [1],
            "model.encoder.layers.1.self_attn": [0, 2], "model.decoder.layers.1.encoder_attn": [1, 2, 3],
            "model.encoder.layers.1.fc2": list(range(0, 16, 2)), "model.decoder.layers.1.fc2": [3, 4, 5]}
    generator = torch.Generator().manual_seed(1)
    sentences = [(torch.randint(4, 40, (n,), generator=generator).tolist() + [2],
                  torch.randint(4, 40, (n - 1,), generator=generator).tolist() + [2], "", "") for n in (5, 9, 7)]
    return model, plan, collate_pairs(sentences, 1, with_texts=False)


def test_a_dropped_layer_is_absent_and_the_rest_keep_their_original_numbers(dropped_layers):
    model, plan, batch = dropped_layers
    pruned = copy.deepcopy(model)
    prune_heads(pruned, plan)
    assert original_layers(pruned) == {"encoder": [1], "decoder": [1]}
    modules = report_modules(pruned, attention_sites(pruned))
    assert modules == [
        (None, "encoder", 0, 4), ("model.encoder.layers.0.self_attn", "encoder", 1, 4),
        (None, "decoder", 0, 4), ("model.decoder.layers.0.self_attn", "decoder", 1, 4),
        (None, "cross", 0, 4), ("model.decoder.layers.0.encoder_attn", "cross", 1, 4),
    ]
    # the measures of the layer now first are those of original layer 1 in the model with layer 0 gated shut
    pruned_sites = attention_sites(pruned)
    now = attention_measures(pruned, [batch], pruned_sites, eos_id=2, progress=False)
    with masked_heads(model, plan):
        sites = [s for s in attention_sites(model) if s.layer == 1]
        reference = attention_measures(model, [batch], sites, eos_id=2, progress=False)
        kept = {s.path: plan.get(s.path, list(range(4))) for s in sites}
    for site in pruned_sites:
        original = site.path.replace(".layers.0.", ".layers.1.")
        for measure, values in now[site.path].items():
            if values is None:
                assert reference[original][measure] is None
                continue
            expected = reference[original][measure][kept[original]]
            assert torch.allclose(values, expected, atol=1e-5), (site.path, measure)
