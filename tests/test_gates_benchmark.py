"""benchmarks/gates.py (issue 38): each gated-phase protocol on the smoke model, its record checked against the run's
own files and the export's independent count of what it kept."""

import csv
import json
import re
from pathlib import Path

import pytest

from gatedprune.costs.timers import TIMERS
from helpers import compose_train, fake_timer, load_benchmark


def test_every_protocol_is_recorded_with_its_three_costs_beside_the_target(tmp_path, monkeypatch, capsys):
    bench = load_benchmark("gates")
    monkeypatch.setitem(TIMERS, "torch", fake_timer)  # the quick setting's latency fit, made in this process
    results, runs = tmp_path / "results", tmp_path / "runs"
    assert bench.main(["quick", "--runs", str(runs), "--results", str(results)]) == 0
    records = bench.records(results)
    assert [r["protocol"] for r in records] == [p.name for p in bench.PROTOCOLS]
    for record in records:
        run = runs / record["cell"]
        target = record["target"]
        export = json.loads((run / "pruned" / "export_report.json").read_text())
        # the export plan's cost is the exported model's, priced by the export itself; it fits the target
        assert record["plan_kept"] == pytest.approx(export["predicted"]["latency"])
        assert record["plan_kept"] <= target + 1e-9
        assert 0 < record["binary_kept"] <= 1 and 0 < record["expected_kept"] <= 1
        # the trajectory is the run's logged gated steps, its target ramping down to the cell's
        logged = [row for row in csv.DictReader((run / "csv" / "metrics.csv").read_text().splitlines())
                  if row.get("train/expected_latency")]
        assert [p["step"] for p in record["trajectory"]] == [int(row["step"]) for row in logged] and logged
        assert record["trajectory"][-1]["target"] == pytest.approx(target)
        assert all(a["target"] >= b["target"] for a, b in zip(record["trajectory"], record["trajectory"][1:]))
        metrics = json.loads((run / "metrics.json").read_text())
        assert record["export"]["kept"] == metrics["kept"] and record["gated"]["kept"] == metrics["gated"]["kept"]
        assert f"gated_steps={record['gated_steps']}" in record["command"]
        # one definition: what the eval mode's mask keeps, as priced, is what the gated model was counted as keeping
        # (a kind that was not gated, nash_300's encoder layers, has no mask: the run kept every one)
        mode = metrics["gated"]["gate_mode"]
        whole = {k: n for k, n in metrics["kept_total"].items() if k not in record["masks"][mode]}
        assert {**whole, **{k: n for k, n in record["masks"][mode].items() if k != "total"}} == metrics["gated"]["kept"]
        protocol = next(p for p in bench.PROTOCOLS if p.name == record["protocol"])
        ungated = any(o.startswith("pruning.kinds=") and "encoder_layer" not in o for o in protocol.overrides)
        assert set(whole) == ({"encoder_layer"} if ungated else set())
        assert ungated == (record["protocol"] in ("nash_300", "depth2_300", "bottom1_300", "bottom2_300",
                                                  "bottom2_flat_300", "bottom2_late_300", "bottom1_late_300"))
        if record["protocol"].startswith("bottom"):  # the decoder's first layers, as many as the protocol says
            depth = int(record["protocol"][len("bottom")])
            kept = json.loads((run / "pruned" / "config.json").read_text())["gatedprune"]["kept_layers"]["decoder"]
            assert kept == list(range(depth)) and record["masks"]["expected_size"]["decoder_layer"] == depth
        assert record["binary_kept"] == pytest.approx(metrics["budget"]["latency"]["binary_kept"])
        fit = metrics["costs"]  # the run's own fit prices those counts (every kind gated; latency has no phantom)
        price = lambda n: fit["base"] + sum(c * n[k] for k, c in fit["coefficients"].items())  # noqa: E731
        for rule in ("binary", "expected_size"):
            assert record[f"{rule}_kept"] == pytest.approx(price({**whole, **record["masks"][rule]})
                                                           / price(metrics["kept_total"]))
        assert record["expected_size_kept"] == pytest.approx(metrics["budget"]["latency"]["expected_size_kept"])
        assert record["masks"]["binary"]["decoder_layer"] >= 1 and record["masks"]["expected_size"]["decoder_layer"] >= 1
        assert len(record["layer_log_alpha"]["decoder_layer"]) == metrics["kept_total"]["decoder_layer"]
    # nash_300 gates no encoder layer: its gated model and export keep every one, and the table says so
    nash = next(r for r in records if r["protocol"] == "nash_300")
    assert "encoder_layer" not in nash["masks"]["expected_size"]
    smoke = compose_train(tmp_path / "compose", "experiment=smoke").model.from_scratch.encoder_layers
    assert nash["gated"]["kept"]["encoder_layer"] == nash["export"]["kept"]["encoder_layer"] == smoke
    readme = (results / "README.md").read_text()
    assert f"| all + {nash['masks']['expected_size']['decoder_layer']} | " in readme  # the expected-size column
    row = next(line for line in readme.splitlines() if line.startswith("| default |"))
    first = records[0]
    assert f"| {bench.off_target(first['binary_kept'], first['target'])} |" in row
    assert bench.off_target(0.5499, 0.55) == "0.550 (+0.0%)" and bench.off_target(0.5, 0.55) == "0.500 (-9.1%)"
    # run again: every cell is already there
    capsys.readouterr()
    assert bench.main(["quick", "--runs", str(runs), "--results", str(results)]) == 0
    assert capsys.readouterr().out.count(": done (in") == len(bench.PROTOCOLS)


def test_an_unknown_cell_is_refused_with_the_cells_there_are(tmp_path):
    bench = load_benchmark("gates")
    with pytest.raises(SystemExit, match=r"error: --cell nope is not a cell; allowed: default_0.55_s1234, "):
        bench.main(["run", "--cell", "nope", "--runs", str(tmp_path), "--results", str(tmp_path / "results")])
    assert not (tmp_path / "results").exists()


def test_the_plan_comparison_counts_each_structure_one_plan_keeps_and_the_other_does_not():
    bench = load_benchmark("plan_repro")
    # an export report's plans: kind -> site -> kept heads or units; stack -> kept layers
    report = {"plan": {"encoder": {"enc.0": [0, 1, 2]}, "cross": {"x.0": [4]}},
              "plan_units": {"decoder_ffn": {"ffn.0": [0, 5]}}, "plan_layers": {"decoder": [0, 2]}}
    other = {"plan": {"encoder": {"enc.0": [0, 2, 3]}, "cross": {"x.0": [4]}},
             "plan_units": {"decoder_ffn": {"ffn.0": [0, 5], "ffn.1": [7]}}, "plan_layers": {"decoder": [0]}}
    a, b = bench.plan_of(report), bench.plan_of(other)
    assert a == {"heads enc.0": [0, 1, 2], "heads x.0": [4], "units ffn.0": [0, 5], "layers decoder": [0, 2]}
    # heads 1 and 3 (one each side), unit 7 of a site only one plan names, decoder layer 2: four in all
    assert bench.plan_difference(a, b) == bench.plan_difference(b, a) == 4 and bench.plan_difference(a, a) == 0
    # the busy run's second process spins while the block runs and is gone after it; a quiet run starts none
    with bench.busy_core(True) as spinner:
        assert spinner.poll() is None  # running
    assert spinner.returncode is not None
    with bench.busy_core(False) as none:
        assert none is None


def test_the_plan_pairs_run_today_s_default_and_record_a_refusal_as_a_result(tmp_path, monkeypatch):
    """``plan_repro.py --protocol first_layers`` runs the default run's gated phase (its pruning and steps, the kept
    table or a fit measured at set-up); a run refused at set-up is a row of the table with its line, not a crash."""
    import subprocess

    bench = load_benchmark("plan_repro")
    default = compose_train(tmp_path)
    for fit in bench.FITS:
        args = bench.args(fit, "busy", tmp_path, "first_layers")
        run = compose_train(tmp_path, *args)
        table = None if fit.startswith("measured") else str(bench.recovery.TABLE)
        # how a run timed its fit until 2026-12-07 (again beyond 20%, three timings, kept at that), as the records
        # of those pairs were made; measured_once_5pct is a run with no table since then, before the joint probes;
        # measured_joint today's default with no table
        one_kind = {"joint_probes": False}
        timing = {"measured": {"keep_tolerance": 0.2, "fit_attempts": 3, **one_kind},
                  "measured_once": {"keep_tolerance": 0.2, "fit_attempts": 3, **one_kind},
                  "measured_5pct": {"fit_tolerance": 0.05, "fit_attempts": 15, **one_kind},
                  "measured_once_5pct": one_kind}.get(fit, {})
        assert run.pruning == {**default.pruning, "workload": {**default.pruning.workload, "table": table, **timing}}
        assert run.gated_steps == default.gated_steps == 300 and run.finetune.steps == 0
        assert args[-1] == f"hydra.run.dir={tmp_path / f'first_layers_widths_{fit}_busy'}"
        # the default of 2026-12-06, whose pairs are the records named first_layers_*: the same preset with its
        # layers settled at step 100 and no widths held
        late = compose_train(tmp_path, *bench.args(fit, "busy", tmp_path, "first_layers_late"))
        assert late.pruning == {**run.pruning, "settle_layers_at": 100, "settle_widths_at": None}
        assert bench.name_of("first_layers_late", fit, "busy") == f"first_layers_{fit}_busy"
    assert compose_train(tmp_path, *bench.args("table", "busy", tmp_path, "preset")).gated_steps == 100
    # measured_once's pair shares one machine cache, emptied before its busy run only: the quiet run reuses its fit;
    # every other run times its own in a cache emptied before it
    for fit in bench.FITS:
        caches = {}
        for load in bench.LOADS:
            caches[load] = bench.machine_cache(fit, load, tmp_path, "first_layers")
            (caches[load] / "latency").mkdir(parents=True, exist_ok=True)
            (caches[load] / "latency" / f"{load}.json").write_text("{}")
        kept = sorted(p.name for p in (caches["quiet"] / "latency").iterdir())
        shared = fit in ("measured_once", "measured_once_5pct")
        assert (caches["busy"] == caches["quiet"]) == shared
        assert kept == (["busy.json", "quiet.json"] if shared else ["quiet.json"])
        assert bench.machine_cache(fit, "busy", tmp_path, "first_layers").exists() is False

    refusal = ("error: pruning.settle_depth={'decoder': 2} keeps at least 0.69 of the dense model's predicted latency "
               "(those layers alone, every other gated structure removed), above pruning.target_latency=0.67; allowed: "
               "{'decoder': 1} (the deepest that fits), or a target of at least 0.69")

    def refused(command, log, env):
        assert env == {"GATEDPRUNE_CACHE": str(tmp_path / "caches" / "first_layers_widths_measured_busy")}
        log.write_text(f"set-up\n{refusal}\n")
        raise subprocess.CalledProcessError(1, command)

    monkeypatch.setattr(bench.recovery, "_run", refused)
    record = bench.run_one("measured", "busy", tmp_path, tmp_path / "results", "first_layers")
    assert record["refused"] == refusal
    assert json.loads((tmp_path / "results" / "first_layers_widths_measured_busy.json").read_text()) == record
    rows = [line for line in bench.table(tmp_path / "results").splitlines() if line.startswith("| first_layers")]
    assert rows == [f"| first_layers | measured | busy | - | - | - | - | - | - | - | - | - | - | refused: {refusal} |"]

    def crashed(command, log, env):  # a traceback, no one-line refusal: raised, nothing recorded to be skipped later
        log.write_text("Traceback (most recent call last):\nRuntimeError: boom\n")
        raise subprocess.CalledProcessError(1, command)

    monkeypatch.setattr(bench.recovery, "_run", crashed)
    with pytest.raises(subprocess.CalledProcessError):
        bench.run_one("table", "busy", tmp_path, tmp_path / "results", "first_layers")
    assert not (tmp_path / "results" / "first_layers_widths_table_busy.json").exists()


def test_a_plan_pair_run_records_its_fit_its_plan_and_what_the_export_scores_before_recovery(tmp_path, monkeypatch):
    """A finished run's record: the fit the run names (its file's probes), the export's plan structure by structure,
    and the export's validation and test BLEU from the run's metrics.json, before any recovery."""
    bench = load_benchmark("plan_repro")
    fit = {"source": "measured", "fit_error": 0.05, "base": 0.1, "coefficients": {"decoder_layer": 0.004}}
    report = {"plan": {"encoder": {"enc.0": [1, 3]}}, "plan_units": {"decoder_ffn": {"dec.0": [0, 2, 5]}},
              "plan_layers": {"decoder": [0, 1]}, "predicted": {"latency": 0.67}}
    metrics = {"kept": {"encoder": 2, "decoder_ffn": 3, "decoder_layer": 2}, "bleu": 13.99, "budget": None,
               "test": {"pruned": {"bleu": 15.05}, "dense": {"bleu": 23.81}}}

    def finished(command, log, env):  # what train.py leaves in the run directory
        run = tmp_path / "first_layers_widths_measured_busy"
        (run / "pruned").mkdir(parents=True)
        (run / "csv").mkdir()
        fitted = run / "checkpoints" / "latency.json"
        fitted.parent.mkdir()
        fitted.write_text(json.dumps({"probes": [{"probe": "dense", "seconds": 0.2, "timings": [0.2], "predicted": 0.2,
                                                  "structures": {}}]}))
        (run / "metrics.json").write_text(json.dumps({**metrics, "costs": {**fit, "path": str(fitted)}}))
        (run / "pruned" / "export_report.json").write_text(json.dumps(report))
        (run / "csv" / "metrics.csv").write_text("step,train/expected_latency,train/target_latency,train/lambda1\n"
                                                 "9,0.7,0.68,0.1\n")
        log.write_text("done\n")

    monkeypatch.setattr(bench.recovery, "_run", finished)
    record = bench.run_one("measured", "busy", tmp_path, tmp_path / "results", "first_layers")
    assert record["bleu"] == {"validation": 13.99, "test": 15.05}
    assert record["plan"] == {"heads enc.0": [1, 3], "units dec.0": [0, 2, 5], "layers decoder": [0, 1]}
    assert record["probes"] == [{"probe": "dense", "seconds": 0.2, "timings": [0.2], "predicted": 0.2}]
    assert record["trajectory"] == [{"step": 9, "target": 0.68, "expected": 0.7, "lambda1": 0.1}]
    assert json.loads((tmp_path / "results" / "first_layers_widths_measured_busy.json").read_text()) == record
    row = next(line for line in bench.table(tmp_path / "results").splitlines() if line.startswith("| first_layers"))
    assert row == ("| first_layers | measured | busy | measured | 5.0% | 100.0 | 4.00 | - | - | 0.670 | all + 2 "
                   "| 13.99 | - | - |")

    # recovered as the grid's cell of today's default at this seed: its command with this export and folder
    cell = json.loads((bench.recovery.RESULTS / f"{bench.RECOVERED_AS}.json").read_text())
    ran = []

    def finetuned(command, log):
        ran.append(command)
        out = tmp_path / "first_layers_widths_measured_busy_recovered"
        out.mkdir()
        (out / "metrics.json").write_text(json.dumps({"finetune": {"shipped_step": 750, "wall_s": 9.0},
                                                      "test": {"pruned": {"bleu": 24.5}}}))

    monkeypatch.setattr(bench.recovery, "_run", finetuned)
    recovered = bench.recover_one("first_layers_widths_measured_busy", tmp_path, tmp_path / "results")
    assert ran[0][1:4] == ["-m", "gatedprune", "finetune"]
    theirs, ours = cell["command"].split(), recovered["recovered"]["command"].split()
    assert ours[1:] == ["RUNS/first_layers_widths_measured_busy/pruned", *theirs[2:5],
                        "RUNS/first_layers_widths_measured_busy_recovered", *theirs[6:]]
    assert theirs[2:5] == ["--teacher", "kept", "--out"]
    assert theirs[6:] == ["finetune.steps=1000", "finetune.lr=0.002", "finetune.warmup_steps=100",
                          "finetune.decay=inverse_sqrt", "finetune.val_check_interval=250",
                          "finetune.save_at=[250,500,1000]", "finetune.init=export", "report.speed=false", "seed=1234"]
    assert recovered["recovered"] == {"as": bench.RECOVERED_AS, "command": recovered["recovered"]["command"],
                                      "shipped_step": 750, "test_bleu": 24.5, "wall_s": 9.0}
    assert json.loads((tmp_path / "results" / "first_layers_widths_measured_busy.json").read_text()) == recovered
    row = next(line for line in bench.table(tmp_path / "results").splitlines() if line.startswith("| first_layers"))
    assert row.endswith("| 13.99 | 24.50 | - |")


def test_today_s_default_ships_one_plan_busy_and_quiet_the_plan_make_train_shipped(tmp_path):
    """docs/gates.md 0c (since 2026-12-07): today's default (the widths held from gated step 200), priced by the kept
    table, shipped one plan beside a busy core and after it; make train's run of the same day shipped it too, and it
    keeps what the grid's gates_bottom2_widths cell kept at seed 1234."""
    bench = load_benchmark("plan_repro")
    pair = [json.loads((bench.RESULTS / f"first_layers_widths_table_{load}.json").read_text()) for load in bench.LOADS]
    assert [r["name"] for r in pair] == [f"first_layers_widths_table_{load}" for load in bench.LOADS]
    assert [r["protocol"] for r in pair] == ["first_layers"] * 2 and [r["load"] for r in pair] == list(bench.LOADS)
    assert all("settle" not in r["command"] and "pruning.workload.table=" in r["command"] for r in pair)
    assert bench.plan_difference(pair[0]["plan"], pair[1]["plan"]) == 0
    shipped = json.loads((bench.ROOT / "docs" / "benchmarks" / "default_run" / "2026-12-07.json").read_text())
    assert bench.plan_difference(pair[0]["plan"], shipped["export_plan"]) == 0
    assert sum(map(len, shipped["export_plan"].values())) == sum(shipped["metrics"]["kept"].values())
    cell = json.loads((bench.recovery.RESULTS / "choose_gates_bottom2_widths_0.67_s1234_1000_lr0.002.json").read_text())
    assert pair[0]["kept"] == pair[1]["kept"] == cell["gated_phase"]["kept"] == shipped["metrics"]["kept"]
    k = pair[0]["kept"]
    page = " ".join((bench.ROOT / "docs" / "gates.md").read_text().split())
    assert (f"**The two runs ship one plan** (0 structures apart: {k['encoder'] + k['decoder'] + k['cross']} heads, "
            f"{k['encoder_ffn']} encoder and {k['decoder_ffn']} decoder FFN units, the decoder's first two layers)"
            ) in page
    assert all(abs(r["budget"]["latency"]["expected_kept"] - 0.67) < 0.001 for r in pair)
    m = shipped["metrics"]
    bleu, fair = m["test"]["pruned"]["bleu"], m["reference"]["test_bleu"]
    assert (f"`make train` shipped {bleu:.2f} test BLEU after {m['steps']} gated and {m['finetune']['steps']} "
            f"fine-tuning steps, {fair - bleu:.2f} below the teacher trained on as long (README)") in page


def test_today_s_default_with_a_measured_fit_is_as_the_page_says():
    """docs/gates.md 0c (2026-12-07): today's default with no table ships one plan when the second run reuses the
    first's fit from the machine cache, two that each time their own differ; every run ends at the target and ships
    its mask; the page's rows, counts and scores before recovery are the records'."""
    bench = load_benchmark("plan_repro")
    root = bench.ROOT
    r = {f"{fit}_{load}": json.loads((bench.RESULTS / f"{bench.name_of('first_layers', fit, load)}.json").read_text())
         for fit in ("table", "measured_once", "measured") for load in bench.LOADS}
    page = " ".join((root / "docs" / "gates.md").read_text().split())
    guide = " ".join((root / "docs" / "guide" / "speed_targets.md").read_text().split())
    for record in r.values():  # every run at the target, its mask shipped (not the fill)
        assert abs(record["budget"]["latency"]["expected_kept"] - 0.67) < 5e-4
        assert record["budget"]["latency"]["plan_rule"] == "expected_size"
        assert record["kept"]["decoder_layer"] == 2 and "settle" not in record["command"]
    once = [r["measured_once_busy"], r["measured_once_quiet"]]
    assert [x["costs"]["source"] for x in once] == ["measured", "cache"]
    assert once[0]["costs"]["coefficients"] == once[1]["costs"]["coefficients"]
    assert "/caches/first_layers_widths_measured_once/latency/" in once[1]["costs"]["path"]
    assert all("pruning.workload.table=null" in x["command"] for x in once + [r["measured_busy"], r["measured_quiet"]])
    assert bench.plan_difference(once[0]["plan"], once[1]["plan"]) == 0
    apart = bench.plan_difference(r["measured_busy"]["plan"], r["measured_quiet"]["plan"])
    late = [json.loads((bench.RESULTS / f"{bench.name_of('first_layers_late', 'measured', load)}.json").read_text())
            for load in bench.LOADS]
    before = bench.plan_difference(*(x["plan"] for x in late))
    assert f"{apart:,} structures apart, about half the {before:,} of" in page
    labels = {"table": "table (the default)", "measured_once": "measured, kept in the machine's cache",
              "measured": "measured, each run its own"}
    loads = {("measured_once", "busy"): "busy: timed it", ("measured_once", "quiet"): "quiet: reused it"}
    for name, record in r.items():
        fit, load = name.rsplit("_", 1)
        c = record["costs"]
        row = (f"| {labels[fit]} | {loads.get((fit, load), load)} | {c['fit_error']:.1%} | {1e3 * c['base']:.1f} | "
               f"{1e3 * c['coefficients']['decoder_layer']:.2f} | {1e3 * c['coefficients']['encoder']:.2f} | "
               f"{1e6 * c['coefficients']['encoder_ffn']:.2f} | {record['budget']['latency']['expected_kept']:.3f} | "
               f"the gated mask | {record['bleu']['validation']:.2f} | "
               f"{bench.plan_difference(r[fit + '_busy']['plan'], r[fit + '_quiet']['plan']):,} |")
        assert row in page, row
    k = once[0]["kept"]
    heads = k["encoder"] + k["decoder"] + k["cross"]
    assert (f"The plan keeps {heads} heads (no encoder head, {k['decoder']} decoder, {k['cross']} cross), all 3,072 "
            f"encoder FFN units and {k['decoder_ffn']:,} decoder ones") in page
    from gatedprune.teacher import TEACHER_DIR

    config = json.loads((Path(TEACHER_DIR) / "config.json").read_text())
    assert k["encoder"] == 0 and k["encoder_ffn"] == config["encoder_ffn_dim"] * config["encoder_layers"] == 3072
    # the encoder's kinds traded by the two fits: the busy fit prices its heads and closes them, the quiet one does not
    busy, quiet = r["measured_busy"], r["measured_quiet"]
    assert busy["kept"]["encoder"] == 0 < busy["costs"]["coefficients"]["encoder"]
    assert quiet["kept"]["encoder"] == 24 and quiet["costs"]["coefficients"]["encoder"] == 0
    price = 1e3 * busy["costs"]["coefficients"]["encoder"]
    assert f"prices an encoder head at {price:.2f} ms and closes all 24" in page
    # each plan before and after the grid's recovery of this protocol and seed, beside the grid's own cells
    grid = {start: json.loads((bench.recovery.RESULTS / name).read_text()) for start, name in (
        ("table", f"{bench.RECOVERED_AS}.json"), ("random", "curve_random_0.67_s1234_2000_lr0.002.json"),
        ("even", "curve_even_layers_0.67_s1234_2000_lr0.002.json"))}
    assert grid["table"]["gated_phase"]["kept"] == r["table_busy"]["kept"] and grid["table"]["steps"] == 1000
    table_bleu = grid["table"]["shipped_test_bleu"]
    random_bleu, even_bleu = (grid[s]["test_bleu_at"]["1000"] for s in ("random", "even"))
    assert r["table_quiet"]["bleu"] == r["table_busy"]["bleu"]
    prices = r["table_busy"]["costs"]  # the kept table's, for every plan
    assert prices["source"] == "table"
    layers = {"encoder": config["encoder_layers"], "decoder": config["decoder_layers"]}
    dense = {"encoder": layers["encoder"] * config["encoder_attention_heads"],
             "decoder": layers["decoder"] * config["decoder_attention_heads"],
             "cross": layers["decoder"] * config["decoder_attention_heads"],
             "encoder_ffn": layers["encoder"] * config["encoder_ffn_dim"],
             "decoder_ffn": layers["decoder"] * config["decoder_ffn_dim"],
             "encoder_layer": layers["encoder"], "decoder_layer": layers["decoder"]}

    def by_the_table(kept):
        return ((prices["base"] + sum(c * kept[k] for k, c in prices["coefficients"].items()))
                / (prices["base"] + sum(c * dense[k] for k, c in prices["coefficients"].items())))

    rows = {"the kept table (the grid's cell)": (r["table_busy"], table_bleu),
            "measured, kept in the machine's cache": (once[0], once[0]["recovered"]["test_bleu"]),
            "measured, the busy run's own": (busy, busy["recovered"]["test_bleu"]),
            "measured, the quiet run's own": (quiet, quiet["recovered"]["test_bleu"])}
    for label, (x, after) in rows.items():
        if "recovered" in x:  # recovered as the grid's cell was, with this run's export
            assert x["recovered"]["as"] == bench.RECOVERED_AS and x["recovered"]["shipped_step"] == 1000
            assert x["recovered"]["command"].split()[1:] == [
                f"RUNS/{x['name']}/pruned", *grid["table"]["command"].split()[2:5], f"RUNS/{x['name']}_recovered",
                *grid["table"]["command"].split()[6:]]
        k = x["kept"]
        row = (f"| {label} | {k['encoder'] + k['decoder'] + k['cross']} | {k['encoder_ffn']:,} + {k['decoder_ffn']:,} | "
               f"{by_the_table(k):.3f} | {x['bleu']['validation']:.2f} | {after:.2f} |")
        assert row in page, row
    worse = sorted((once[0]["recovered"]["test_bleu"], busy["recovered"]["test_bleu"]))
    assert worse[-1] < random_bleu < even_bleu < table_bleu and quiet["recovered"]["test_bleu"] > even_bleu
    assert (f"Random structures scored {random_bleu:.2f} and even layers {even_bleu:.2f} at this seed after 1,000 "
            f"steps (the recovery grid). Two of the three measured fits gave plans {random_bleu - worse[1]:.1f} and "
            f"{random_bleu - worse[0]:.1f} BLEU below random structures, {table_bleu - worse[0]:.2f} and "
            f"{table_bleu - worse[1]:.2f} below the kept table's plan. The third (the quiet run's fit, "
            f"{quiet['costs']['fit_error']:.1%} off its probes) came within "
            f"{table_bleu - quiet['recovered']['test_bleu']:.2f} of it, with a larger model") in page
    assert (f"after the same 1,000 steps of recovery {worse[0]:.2f} and {worse[1]:.2f} test BLEU, below random "
            f"structures ({random_bleu:.2f}), where the kept table's plan scored {table_bleu:.2f} and the third "
            f"measured fit's {quiet['recovered']['test_bleu']:.2f}") in page
    # why: the two worse plans' fits priced the encoder's and cross heads above the kept table's, and their gates
    # closed heads; by the kept table's prices those plans are larger than its own
    ms = {n: {k: 1e3 * x["costs"]["coefficients"][k] for k in ("encoder", "cross")}
          for n, x in (("once", once[0]), ("busy", busy), ("table", r["table_busy"]))}
    assert (f"an encoder head at {ms['once']['encoder']:.2f} and {ms['busy']['encoder']:.2f} ms, a cross head at "
            f"{ms['once']['cross']:.2f} and {ms['busy']['cross']:.2f} ms, against {ms['table']['encoder']:.0f} and "
            f"{ms['table']['cross']:.2f} in the kept table") in page
    for n in ("once", "busy"):
        assert all(ms[n][k] > ms["table"][k] for k in ("encoder", "cross"))
    heads = {n: sum(x["kept"][k] for k in ("encoder", "decoder", "cross")) for n, x in
             (("once", once[0]), ("busy", busy), ("table", r["table_busy"]))}
    assert heads["once"] < heads["busy"] < heads["table"]
    assert (f"larger than its own ({by_the_table(once[0]['kept']):.3f} and {by_the_table(busy['kept']):.3f} of the "
            "dense latency), and worse") in page
    assert (f"({by_the_table(quiet['kept']):.3f} of the dense latency by the kept table's prices, against "
            f"{by_the_table(r['table_busy']['kept']):.3f})") in page
    assert (f"scored {worse[0]:.2f}, {worse[1]:.2f} and {quiet['recovered']['test_bleu']:.2f} test BLEU, the kept "
            f"table's {table_bleu:.2f} and random structures {random_bleu:.2f}, from the same seed") in guide
    assert f"two of today's default, each with the run's own fit (20%), {apart:,} apart" in guide
    assert f"and two of today's default {apart:,} apart (at 20%)" in page
    readme = " ".join((root / "README.md").read_text().split())
    assert f"two that each timed their own fit did not, {apart:,} structures apart, so a fit timed once" in readme
    assert all(len(p["timings"]) == 1 for x in (once[0], busy, quiet) for p in x["probes"])


def _teacher_prices():
    """(the kept table's cost of a kept-counts mapping as a fraction of the dense teacher's) from the teacher's config
    and the table pair's record: the price the page gives each plan."""
    from gatedprune.teacher import TEACHER_DIR

    bench = load_benchmark("plan_repro")
    config = json.loads((Path(TEACHER_DIR) / "config.json").read_text())
    prices = json.loads((bench.RESULTS / "first_layers_widths_table_busy.json").read_text())["costs"]
    e, d = config["encoder_layers"], config["decoder_layers"]
    dense = {"encoder": e * config["encoder_attention_heads"], "decoder": d * config["decoder_attention_heads"],
             "cross": d * config["decoder_attention_heads"], "encoder_ffn": e * config["encoder_ffn_dim"],
             "decoder_ffn": d * config["decoder_ffn_dim"], "encoder_layer": e, "decoder_layer": d}

    def cost(kept):
        return ((prices["base"] + sum(c * kept[k] for k, c in prices["coefficients"].items()))
                / (prices["base"] + sum(c * dense[k] for k, c in prices["coefficients"].items())))

    return cost


def test_a_fit_kept_at_5pct_and_which_fit_predicts_this_machine_are_as_the_page_says():
    """docs/gates.md 0c (2026-12-07): the pair with the fit kept for later runs at 5% ships one plan, as the page
    counts it, and recovers as it says; the speed stage's table is the page's, and its sentences are the record's."""
    bench = load_benchmark("plan_repro")
    page = " ".join((bench.ROOT / "docs" / "gates.md").read_text().split())
    busy, quiet = (json.loads((bench.RESULTS / f"first_layers_widths_measured_once_5pct_{load}.json").read_text())
                   for load in bench.LOADS)
    assert (busy["costs"]["source"], quiet["costs"]["source"]) == ("measured", "cache")
    assert busy["costs"]["coefficients"] == quiet["costs"]["coefficients"]
    assert "/caches/first_layers_widths_measured_once_5pct/latency/" in quiet["costs"]["path"]
    assert all("pruning.workload.keep_tolerance=0.05 pruning.workload.fit_attempts=15" in r["command"]
               and "pruning.workload.table=null" in r["command"] for r in (busy, quiet))
    assert bench.plan_difference(busy["plan"], quiet["plan"]) == 0 and busy["costs"]["fit_error"] <= 0.05
    timings = len(busy["probes"][0]["timings"])
    assert timings == 1 and (f"Its first timing met its probes within {busy['costs']['fit_error']:.1%}, so it took "
                             "no retry") in page
    k, c = busy["kept"], busy["costs"]["coefficients"]
    table = json.loads((bench.RESULTS / "first_layers_widths_table_busy.json").read_text())
    t, tk = table["costs"]["coefficients"], table["kept"]
    assert [k[x] for x in ("encoder", "decoder", "cross")] == [tk[x] for x in ("encoder", "decoder", "cross")]
    cost = _teacher_prices()
    assert (f"The plan keeps the kept table's heads to the count ({k['encoder']} encoder, {k['decoder']} decoder, "
            f"{k['cross']} cross heads), {k['encoder_ffn']:,} encoder and {k['decoder_ffn']:,} decoder FFN units (the "
            f"kept table's plan: {tk['encoder_ffn']:,} and {tk['decoder_ffn']:,})") in page
    assert (f"(an encoder unit {1e6 * c['encoder_ffn']:.2f} us, a decoder unit {1e6 * c['decoder_ffn']:.2f} us; the "
            f"table {1e6 * t['encoder_ffn']:.2f} and {1e6 * t['decoder_ffn']:.2f}), so at "
            f"{busy['budget']['latency']['expected_kept']:.3f} of its own fit the plan is {cost(k):.3f} of the dense "
            "latency by the table's prices") in page
    grid = {start: json.loads((bench.recovery.RESULTS / name).read_text()) for start, name in (
        ("table", f"{bench.RECOVERED_AS}.json"), ("random", "curve_random_0.67_s1234_2000_lr0.002.json"),
        ("even", "curve_even_layers_0.67_s1234_2000_lr0.002.json"))}
    after = busy["recovered"]["test_bleu"]
    random_bleu, even_bleu = (grid[x]["test_bleu_at"]["1000"] for x in ("random", "even"))
    table_bleu = grid["table"]["shipped_test_bleu"]
    assert busy["recovered"]["as"] == bench.RECOVERED_AS and busy["recovered"]["shipped_step"] == 1000
    assert (f"It scores {busy['bleu']['validation']:.2f} validation BLEU as exported and, recovered as the grid "
            f"recovers this protocol at this seed (`plan_repro.py recover --fit measured_once_5pct --load busy`), "
            f"{after:.2f} test BLEU after 1,000 steps: above random structures ({random_bleu:.2f}) and even layers "
            f"({even_bleu:.2f}) at this seed, {table_bleu - after:.2f} below the kept table's plan "
            f"({table_bleu:.2f})") in page
    assert random_bleu < even_bleu < after < table_bleu
    # the page's table of both pairs timed to 5%: each run's fit, plan, price by the kept table, scores
    labels = {"measured_once_5pct": "to 5%, kept in the machine's cache", "measured_5pct": "to 5%, each run its own"}
    loads = {("measured_once_5pct", "busy"): "busy: timed it", ("measured_once_5pct", "quiet"): "quiet: reused it"}
    for fit in labels:
        pair = [json.loads((bench.RESULTS / f"first_layers_widths_{fit}_{load}.json").read_text())
                for load in bench.LOADS]
        for r in pair:
            c, k = r["costs"], r["kept"]
            assert c["fit_error"] <= 0.05 and abs(r["budget"]["latency"]["expected_kept"] - 0.67) < 5e-4
            recovered = f"{r['recovered']['test_bleu']:.2f}" if "recovered" in r else "-"
            row = (f"| {labels[fit]} | {loads.get((fit, r['load']), r['load'])} | {len(r['probes'][0]['timings'])} | "
                   f"{c['fit_error']:.1%} | {1e3 * c['base']:.1f} | {1e3 * c['coefficients']['decoder_layer']:.2f} | "
                   f"{1e3 * c['coefficients']['encoder']:.2f} | {1e3 * c['coefficients']['cross']:.2f} | "
                   f"{1e6 * c['coefficients']['encoder_ffn']:.2f} | {1e6 * c['coefficients']['decoder_ffn']:.2f} | "
                   f"{k['encoder'] + k['decoder'] + k['cross']} | {k['encoder_ffn']:,} + {k['decoder_ffn']:,} | "
                   f"{cost(k):.3f} | {r['bleu']['validation']:.2f} | {recovered} | "
                   f"{bench.plan_difference(pair[0]['plan'], pair[1]['plan']):,} |")
            assert row in page, row
    own = [json.loads((bench.RESULTS / f"first_layers_widths_measured_5pct_{load}.json").read_text())
           for load in bench.LOADS]
    apart = bench.plan_difference(own[0]["plan"], own[1]["plan"])
    assert apart > 0 and f"Two runs that each time their own fit to 5% still ship two plans**, {apart:,} " in page
    assert all(r["costs"]["source"] == "measured" and "fit_tolerance=0.05" in r["command"] for r in own)
    # the speed stage: its table is on the page, and what the page says of it is the record's
    for name in ("speed_first_layers.json", "speed_first_layers_b.json"):
        speed = json.loads((bench.RESULTS / name).read_text())
        assert bench.speed_table(speed) in (bench.ROOT / "docs" / "gates.md").read_text()
        table_off = [abs(r["kept_table"] / r["measured"] - 1) for r in speed["rows"]]
        own_off = [r["own_fit"] / r["measured"] - 1 for r in speed["rows"]]
        assert all(abs(r["own_fit"] - speed["rows"][0]["own_fit"]) < 0.005 for r in speed["rows"])
        assert f"within {100 * max(table_off):.0f}% of its measured speed-up" in page, name
        assert f"off by {100 * min(own_off):+.0f}% to {100 * max(own_off):+.0f}%" in page, name


def test_the_joint_probes_section_is_the_records():
    """docs/gates.md 0c (the evening of 2026-12-07): the joint probes' replays are the fit_spread page's rows, the
    pair of runs that each timed their own fit on the 17 probes is its records, and every number the bullets give."""
    bench = load_benchmark("plan_repro")
    spread = load_benchmark("fit_spread")
    text = (bench.ROOT / "docs" / "gates.md").read_text()
    page = " ".join(text.split())
    section = page[page.index("**Probes that cut every kind at once"):page.index("## 0h.")]
    readme = (spread.ROOT / "docs" / "benchmarks" / "fit_spread" / "joint" / "README.md").read_text()
    rows = {}
    for line in readme.split("How the same fits price")[1].splitlines():
        if line.startswith(("| busy |", "| quiet |")):
            cells = line.strip("| ").split(" | ")
            rows[(cells[0], cells[1])] = cells[2:]
            if "orders" in cells[1]:
                assert line in text, line  # the page quotes the replays over 20 orders as the page of records has them
    joint, alone = "5% tolerance, 20 orders", "5% tolerance, 20 orders, one kind per probe"
    q, q1, b, b1 = rows[("quiet", joint)], rows[("quiet", alone)], rows[("busy", joint)], rows[("busy", alone)]
    assert (f"one plan's predicted speed-up moved {q[3]} (sd / mean) across the quiet record's fits and {b[3]} across "
            f"the busy record's, against {q1[3]} and {b1[3]} from the same timings") in section
    assert (f"its worst miss over the plans went from {q1[2]} to {q[2]} alone and from {b1[2]} to {b[2]} beside the busy "
            f"core; the median miss from {q1[1]} to {q[1]} alone and from {b1[1]} to {b[1]} beside the busy core") in section
    assert float(q[3][:-1]) < float(q1[3][:-1]) and float(b[3][:-1]) < float(b1[3][:-1])  # moves less, both loads
    took = {}
    for line in readme.split("How the same fits price")[0].splitlines():
        if "orders" in line and line.startswith(("| busy |", "| quiet |")):
            cells = line.strip("| ").split(" | ")
            took[(cells[0], cells[1])] = (cells[2], cells[3])
    refused = [took[("quiet", how)][0].split("(+")[1].split(" ")[0] for how in (joint, alone)]
    assert (f"({took[('busy', joint)][1]} against {took[('busy', alone)][1]} beside the busy core, "
            f"{took[('quiet', joint)][1]} against {took[('quiet', alone)][1]} alone); the orders that never met 5% "
            f"({refused[0]} and {refused[1]} of 20 alone)") in section
    # the encoder's two kinds over those orders (the shares table of the same page)
    shares = {}
    for line in readme.split("How the same fits price")[0].splitlines():
        if "orders" in line and line.startswith(("| busy |", "| quiet |")):
            cells = line.strip("| ").split(" | ")
            shares[(cells[0], cells[1])] = dict(zip(["base", *spread.ALL_KINDS], cells[5:]))
    sq, sb = shares[("quiet", joint)], shares[("busy", joint)]
    assert (f"the encoder's heads ranged {sq['encoder']}% and its FFN units {sq['encoder_ffn']}% of the quiet record's "
            f"latency, {sb['encoder']}% and {sb['encoder_ffn']}% of the busy record's") in section
    # the earlier plans' measured speed-ups, from measurement to measurement
    measured = {}
    for name in ("speed_first_layers.json", "speed_first_layers_b.json", "speed_first_layers_c.json"):
        for row in json.loads((bench.RESULTS / name).read_text())["rows"]:
            measured.setdefault(row["name"], []).append(row["measured"])
    moved = max(max(v) / min(v) - 1 for v in measured.values() if len(v) == 3)
    assert f"which moved by up to {100 * moved:.0f}% between measurements" in section
    assert f"moves by up to {100 * moved:.0f}% between measurements three hours apart" in section
    for record in ("busy", "quiet"):  # the 17 probes, timed by today's default workload
        timed = json.loads((spread.ROOT / "docs" / "benchmarks" / "fit_spread" / "joint" / f"{record}.json").read_text())
        assert timed["workload"]["joint_probes"] is True and len(timed["probes"]) == 17 == len(timed["timings"][0])
    # the pair: the records' fits, plans, prices by the kept table and scores, as the page's rows
    pair = [json.loads((bench.RESULTS / f"first_layers_widths_measured_joint_{load}.json").read_text())
            for load in bench.LOADS]
    apart = bench.plan_difference(pair[0]["plan"], pair[1]["plan"])
    cost = _teacher_prices()
    for r in pair:
        c, k = r["costs"], r["kept"]
        assert c["source"] == "measured" and "joint_probes" not in r["command"] and len(r["probes"]) == 17
        assert c["fit_error"] <= 0.05 and abs(r["budget"]["latency"]["expected_kept"] - 0.67) < 5e-4
        assert [p["probe"] for p in r["probes"][-2:]] == ["every kind 0.5", "every kind 0"]
        recovered = f"{r['recovered']['test_bleu']:.2f}" if "recovered" in r else "-"
        row = (f"| on 17 probes, each run its own | {r['load']} | {len(r['probes'][0]['timings'])} | "
               f"{c['fit_error']:.1%} | {1e3 * c['base']:.1f} | {1e3 * c['coefficients']['decoder_layer']:.2f} | "
               f"{1e3 * c['coefficients']['encoder']:.2f} | {1e3 * c['coefficients']['cross']:.2f} | "
               f"{1e6 * c['coefficients']['encoder_ffn']:.2f} | {1e6 * c['coefficients']['decoder_ffn']:.2f} | "
               f"{k['encoder'] + k['decoder'] + k['cross']} | {k['encoder_ffn']:,} + {k['decoder_ffn']:,} | "
               f"{cost(k):.3f} | {r['bleu']['validation']:.2f} | {recovered} | {apart:,} |")
        assert row in page, row
    busy, quiet = pair
    assert f"They still ship two plans, {apart:,} structures apart**" in section
    assert (f"an encoder head at {1e3 * busy['costs']['coefficients']['encoder']:.2f} ms and an encoder FFN unit at "
            "nothing") in section and busy["costs"]["coefficients"]["encoder_ffn"] == 0 and busy["kept"]["encoder"] == 0
    assert (f"its units at {1e6 * quiet['costs']['coefficients']['encoder_ffn']:.2f} us: it kept every encoder head and "
            f"{quiet['kept']['encoder_ffn']} of 3,072 units") in section and quiet["costs"]["coefficients"]["encoder"] == 0
    base = [f"{100 * r['costs']['base'] / r['probes'][0]['seconds']:.0f}%" for r in pair]
    assert (f"{base[0]} and {base[1]} of the dense probe's time here ({1e3 * busy['costs']['base']:.1f} and "
            f"{1e3 * quiet['costs']['base']:.1f} ms)" in section
            and f"cost {cost(busy['kept']):.3f} and {cost(quiet['kept']):.3f} of the dense latency" in section)
    # the recovery of both plans, against the grid's starting points at this seed
    grid = {start: json.loads((bench.recovery.RESULTS / name).read_text()) for start, name in (
        ("table", f"{bench.RECOVERED_AS}.json"), ("random", "curve_random_0.67_s1234_2000_lr0.002.json"),
        ("even", "curve_even_layers_0.67_s1234_2000_lr0.002.json"))}
    random_bleu, even_bleu = (grid[x]["test_bleu_at"]["1000"] for x in ("random", "even"))
    after = [r["recovered"]["test_bleu"] for r in pair]
    assert all(r["recovered"]["as"] == bench.RECOVERED_AS and r["recovered"]["shipped_step"] == 1000 for r in pair)
    assert (f"{after[0]:.2f} (the busy run's, no encoder head) and {after[1]:.2f} test BLEU after the same 1,000 steps, "
            f"against random structures {random_bleu:.2f}, even layers {even_bleu:.2f} and the kept table's plan "
            f"{grid['table']['shipped_test_bleu']:.2f}") in section
    assert f"The busy run's plan is {random_bleu - after[0]:.2f} below random structures" in section
    assert after[0] < random_bleu < even_bleu < after[1] < grid["table"]["shipped_test_bleu"]
    # the third speed measurement: its table, and what the page says of it
    speed = json.loads((bench.RESULTS / "speed_first_layers_c.json").read_text())
    assert bench.speed_table(speed) in text
    kept_off = [r["kept_table"] / r["measured"] - 1 for r in speed["rows"]]
    own_off = [r["own_fit"] / r["measured"] - 1 for r in speed["rows"]]
    assert (f"the kept table predicted the nine plans within {100 * max(map(abs, kept_off)):.0f}% "
            f"({100 * min(kept_off):+.0f}% to {100 * max(kept_off):+.0f}%), the runs' own fits within "
            f"{100 * min(own_off):+.0f}% to {100 * max(own_off):+.0f}%") in section and len(speed["rows"]) == 9
    quiet_one_kind = [f"{100 * (r['own_fit'] / r['measured'] - 1):+.0f}%" for r in speed["rows"]
                      if r["name"].endswith(("measured_quiet", "measured_5pct_quiet"))]
    assert f"were off by only {quiet_one_kind[0]} and {quiet_one_kind[1]}, closer than the kept table" in section
    for name in ("speed_first_layers.json", "speed_first_layers_b.json"):  # "at least as close for every plan"
        assert all(abs(r["kept_table"] / r["measured"] - 1) <= abs(r["own_fit"] / r["measured"] - 1) + 1e-9
                   for r in json.loads((bench.RESULTS / name).read_text())["rows"])
    joint_rows = [r for r in speed["rows"] if r["fit"] == "measured_joint"]
    assert (f"ran at {joint_rows[0]['measured']:.2f}x and {joint_rows[1]['measured']:.2f}x where their fits predicted "
            f"{joint_rows[0]['own_fit']:.2f}x") in section
    # the base share of the fits timed to 5% on one-kind probes, and of the kept table, as the opening says
    shares = sorted(r["costs"]["base"] / r["probes"][0]["seconds"] for r in (
        json.loads((bench.RESULTS / f"first_layers_widths_{name}.json").read_text())
        for name in ("measured_5pct_busy", "measured_5pct_quiet", "measured_once_5pct_busy")))
    table = json.loads(bench.recovery.TABLE.read_text())
    assert (f"put it at {100 * shares[0]:.0f}%, {100 * shares[1]:.0f}% and {100 * shares[2]:.0f}% of their dense "
            f"probe's time, the kept table at {100 * table['base'] / table['probes'][0]['seconds']:.0f}%") in section


def test_the_fit_spread_pages_price_the_measured_plans_as_the_records_say():
    """benchmarks/fit_spread.py's pricing tables: the plans are the speed records' (the mean measured speed-up per
    plan), and the fit of every timing (no replay) prices them as each page's row says."""
    spread = load_benchmark("fit_spread")
    bench = load_benchmark("plan_repro")
    measured = {}
    for path in sorted(bench.RESULTS.glob("speed_*.json")):
        for row in json.loads(path.read_text())["rows"]:
            measured.setdefault(row["name"], []).append(row["measured"])
    plans = spread.measured_plans()
    assert set(plans) == set(measured) and len(plans) == 9
    for name, (kept, speed_up) in plans.items():
        assert kept == json.loads((bench.RESULTS / f"{name}.json").read_text())["kept"]
        assert speed_up == pytest.approx(sum(measured[name]) / len(measured[name]))
    for results in (spread.RESULTS, spread.RESULTS / "joint"):
        readme = (results / "README.md").read_text().split("How the same fits price")[1]
        for load in spread.LOADS:
            record = json.loads((results / f"{load}.json").read_text())
            dense = record["probes"][0]["structures"]
            fit = spread.pooled(record)
            predicted = [spread.speed_up(fit["shares"], dense, kept) for kept, _ in plans.values()]
            off = [abs(p / m - 1) for p, (_, m) in zip(predicted, plans.values())]
            assert f"| {load} | every timing | 1 | {sum(off) / len(off):.1%} | {max(off):.1%} | - |" in readme


def test_the_plan_pairs_of_the_default_of_2026_12_06_are_the_committed_records(tmp_path):
    """docs/gates.md 0c and the README: the default of 2026-12-06, priced by the teacher's kept table, shipped one plan
    busy and quiet; with a fit measured at set-up its two plans differed, by the count the page gives."""
    bench = load_benchmark("plan_repro")
    record = {n: json.loads((bench.RESULTS / f"first_layers_{n}.json").read_text())
              for n in ("table_busy", "table_quiet", "measured_busy", "measured_quiet")}
    assert bench.plan_difference(record["table_busy"]["plan"], record["table_quiet"]["plan"]) == 0
    # the plan make train shipped that day (docs/benchmarks/default_run/), structure by structure
    shipped = json.loads((bench.ROOT / "docs" / "benchmarks" / "default_run" / "2026-12-06.json").read_text())
    assert bench.plan_difference(record["table_busy"]["plan"], shipped["export_plan"]) == 0
    # every kept structure of every kind, layers too
    assert sum(map(len, shipped["export_plan"].values())) == sum(shipped["metrics"]["kept"].values())
    for name in ("table_busy", "table_quiet"):  # the table the default prices the teacher with
        assert f"pruning.workload.table={bench.recovery.TABLE.relative_to(bench.ROOT)}" in record[name]["command"]
    assert compose_train(tmp_path).pruning.workload.table == str(bench.recovery.TABLE)
    apart = bench.plan_difference(record["measured_busy"]["plan"], record["measured_quiet"]["plan"])
    page = " ".join((bench.ROOT / "docs" / "gates.md").read_text().split())
    assert apart > 0 and f"the two plans differ in {apart:,} structures" in page
    # fits timed until they miss their probes by 5%: closer, not the same plan
    tight = [json.loads((bench.RESULTS / f"first_layers_measured_5pct_{load}.json").read_text())
             for load in bench.LOADS]
    assert all(r["costs"]["fit_error"] <= 0.05 and "fit_tolerance=0.05" in r["command"] for r in tight)
    closer = bench.plan_difference(tight[0]["plan"], tight[1]["plan"])
    assert 0 < closer < apart and f"The two plans still differ in {closer:,} structures" in page
    guide = " ".join((bench.ROOT / "docs" / "guide" / "speed_targets.md").read_text().split())
    assert f"one beside a busy core, shipped plans {closer:,} structures apart" in guide
    for r in tight:  # the page's row: the fit, the expected cost at the end, the count
        c, expected = r["costs"], r["budget"]["latency"]["expected_kept"]
        row = (f"| measured to 5% | {r['load']} | {c['fit_error']:.1%} | {1e3 * c['base']:.1f} | "
               f"{1e3 * c['coefficients']['decoder_layer']:.2f} | {1e3 * c['coefficients']['encoder']:.2f} | "
               f"{1e6 * c['coefficients']['encoder_ffn']:.2f} | {expected:.3f} | ")
        assert row in page, row
    # one fit per machine: the busy run timed it into the pair's machine cache, the quiet run was priced by it
    once = [json.loads((bench.RESULTS / f"first_layers_measured_once_{load}.json").read_text()) for load in bench.LOADS]
    assert [r["costs"]["source"] for r in once] == ["measured", "cache"]
    assert "/caches/first_layers_measured_once/latency/" in once[1]["costs"]["path"]
    assert all("GATEDPRUNE_CACHE=RUNS/caches/first_layers_measured_once " in r["command"] for r in once)
    assert once[0]["costs"]["coefficients"] == once[1]["costs"]["coefficients"]
    assert bench.plan_difference(once[0]["plan"], once[1]["plan"]) == 0
    assert "the first beside a busy core, shipped one plan (0 structures apart" in guide
    assert "**The two runs ship one plan**: 0 structures apart, where two runs that each timed their own fit were " \
           f"{closer:,} and {apart:,} apart" in page
    for r, how in zip(once, ("busy: timed it", "quiet: reused it")):
        c, expected = r["costs"], r["budget"]["latency"]["expected_kept"]
        row = (f"| {how} | {c['fit_error']:.1%} | {1e3 * c['base']:.1f} | "
               f"{1e3 * c['coefficients']['decoder_layer']:.2f} | {1e3 * c['coefficients']['encoder']:.2f} | "
               f"{1e6 * c['coefficients']['encoder_ffn']:.2f} | {expected:.3f} | the fill (the mask missed the "
               "target) | 0 |")
        assert row in page and r["budget"]["latency"]["plan_rule"] == "latency", row


def test_the_fit_spread_replays_the_fit_a_run_makes_and_gives_each_kind_its_share(tmp_path):
    """benchmarks/fit_spread.py: every probe timed several times; each run's fit is ``fit_latency`` replayed on three
    consecutive timings as its retries take them, and each kind's share of the dense latency is c_k n_k / total."""
    from helpers import FAKE_BASE, FAKE_COSTS, bart_structures, tiny_bart3

    bench = load_benchmark("fit_spread")
    model = tiny_bart3()
    calls = []

    def timer(models, workload):  # the fake clock, slower each call by a factor common to every probe
        calls.append(len(models))
        return [(1 + 0.1 * len(calls)) * (FAKE_BASE + sum(FAKE_COSTS[k] * n for k, n in bart_structures(m).items()))
                for m in models]

    record = bench.measure(model, "quiet", 6, timer)
    assert len(record["timings"]) == len(calls) == 6 and set(calls) == {len(record["probes"])}
    assert record["probes"][0] == {"probe": "dense", "structures": bart_structures(model)}
    # today's default's probes: each kind alone, then every kind at once (what the record says it timed)
    assert record["workload"]["joint_probes"] is True and [p["probe"] for p in record["probes"][-2:]] == [
        "every kind 0.5", "every kind 0"]
    dense = bart_structures(model)
    total = FAKE_BASE + sum(FAKE_COSTS[k] * n for k, n in dense.items())
    expected = {"base": FAKE_BASE / total, **{k: FAKE_COSTS[k] * n / total for k, n in dense.items()}}
    found = bench.fits(model, record, orders=3)  # three orders of the timings (the benchmark's 20 take a while)
    assert len(found["a run"]) == 2 and len(found["one timing"]) == 6 and found["every timing"][0]["timings"] == 6
    assert len(found["5% tolerance, 3 orders"]) == len(found["5% tolerance, 3 orders, one kind per probe"]) == 3
    for fit in [f for fits in found.values() for f in fits]:  # a factor common to all probes leaves every share
        assert fit["shares"] == pytest.approx(expected, abs=1e-9) and fit["error"] < 1e-9
        assert sum(fit["shares"].values()) == pytest.approx(1)
    assert [fit["timings"] for fit in found["a run"] + found["5% tolerance"]] == [1, 1, 1]
    # a record of the probes of one kind each (every record before the joint probes) is replayed on those alone
    single = len(record["probes"]) - 2
    old = {**record, "workload": {k: v for k, v in record["workload"].items() if k != "joint_probes"},
           "probes": record["probes"][:single], "timings": [t[:single] for t in record["timings"]]}
    assert list(bench.fits(model, old)) == ["a run", "one timing", "every timing", "5% tolerance"]
    assert bench.fits(model, old)["a run"][0]["shares"] == pytest.approx(expected, abs=1e-9)

    # each probe off by its own factor in each timing, 3x, 1x or 0.3x, so that no timing, nor the median of two, fits
    # within 20%: the run times three times and the median of three (1x for every probe) gives the exact shares
    exact = [FAKE_BASE + sum(FAKE_COSTS[k] * n for k, n in probe["structures"].items()) for probe in record["probes"]]
    factors = [(3, 1, 0.3), (1, 0.3, 3), (0.3, 3, 1)]
    skewed = [[t * factors[j % 3][i] for j, t in enumerate(exact)] for i in range(3)]
    run = bench.replay(model, skewed, joint=True)
    assert run["timings"] == 3 and run["shares"] == pytest.approx(expected, abs=1e-9)
    assert bench.pooled({**record, "timings": skewed})["shares"] == pytest.approx(expected, abs=1e-9)
    assert bench.replay(model, skewed[:2], joint=True)["refused"].startswith("the latency fit misses its probe")
    assert bench.replay(model, skewed, tolerance=0.05, joint=True)["timings"] == 3
    # in the table: the skewed run took three timings, the other one; each skewed timing alone is refused; the median
    # of all six (1.45x every probe) and the run at 5% (exact after three) give the exact shares
    (tmp_path / "quiet.json").write_text(json.dumps({**record, "timings": skewed + record["timings"][3:]}))
    rows = [line.split(" | ") for line in bench.table(model, tmp_path, kept=None, orders=3).splitlines()[2:]]
    assert [row[1:4] for row in rows[:4]] == [["a run", "2", "1-3"], ["one timing", "3 (+3 refused)", "1"],
                                              ["every timing", "1", "6"], ["5% tolerance", "1", "3"]]
    # over three orders of the six timings, with the joint probes and without them: every fit made is exact
    assert [row[1:3] for row in rows[4:]] == [["5% tolerance, 3 orders", "3"],
                                              ["5% tolerance, 3 orders, one kind per probe", "3"]]
    assert all(re.fullmatch(r"[1-6](-[1-6])?", row[3]) for row in rows[4:])
    share = f"{100 * expected['decoder_ffn']:.1f}"
    column = 6 + list(bench.ALL_KINDS).index("decoder_ffn")
    assert [row[column] for row in rows] == [share] * 6  # every fit the same: one number
    # the plans priced by those fits: a plan that ran as the fake clock says is off by nothing, one that ran 10% slower
    # by 10%; the mean over the two plans is a fit's miss, and exact fits do not move from fit to fit
    half = {k: n // 2 if not k.endswith("_layer") else n for k, n in dense.items()}
    exact_speed_up = total / (FAKE_BASE + sum(FAKE_COSTS[k] * n for k, n in half.items()))
    plans = {"as timed": (half, exact_speed_up), "slower": (half, exact_speed_up / 1.1)}
    priced = [line.split(" | ") for line in bench.price_table(model, tmp_path, plans, orders=3).splitlines()[2:]]
    assert [row[1] for row in priced] == ["a run", "every timing", "5% tolerance", "5% tolerance, 3 orders",
                                          "5% tolerance, 3 orders, one kind per probe"]  # no timing alone
    assert all(row[3:5] == ["5.0%", "10.0%"] for row in priced)
    assert [row[5].strip(" |") for row in priced] == ["0.0%", "-", "-", "0.0%", "0.0%"]
    # fits that disagree: one prices the whole model as its base (1.0x), one half of it as the decoder's FFN, which the
    # plan removes (2.0x): the plan's prediction moves by sd / mean = 0.5 / 1.5, and each fit's miss is 0% and 100%
    base = {"base": 1.0, **dict.fromkeys(bench.ALL_KINDS, 0.0)}
    ffn = {**base, "base": 0.5, "decoder_ffn": 0.5}
    cut = {**dense, "decoder_ffn": 0}
    assert bench.pricing([{"shares": base}, {"shares": ffn}, {"refused": "..."}], dense, {"p": (cut, 1.0)}) == [
        "50.0%", "100.0%", "33.3%"]

    # the kept table beside them: its error over its probes as the file's own predictions give it
    kept = json.loads(bench.LATENCY_TABLE.read_text())
    last = bench.table(model, tmp_path, orders=1).splitlines()[-1].split(" | ")
    error = max(abs(p["predicted"] / p["seconds"] - 1) for p in kept["probes"])
    assert last[1:5] == ["the kept table (teacher_latency.json)", "1", "-", f"{error:.1%}"]
    # a range is lowest-highest as numbers (9.5 below 10.0), over the fits made
    fits = [{"shares": {"base": 0.1}}, {"refused": "..."}, {"shares": {"base": 0.095}}, {"shares": {"base": 0.25}}]
    assert bench.spread(fits, "base") == "9.5-25.0" and bench.spread(fits[1:2], "base") == "-"
    # timings of another model are refused, not fitted to this one's counts
    (tmp_path / "quiet.json").write_text(json.dumps({**record, "probes": record["probes"][1:] + record["probes"][:1]}))
    with pytest.raises(ValueError, match="timed the probes of another model"):
        bench.table(model, tmp_path, kept=None, orders=1)

    with pytest.raises(SystemExit) as exit_:  # a run is three timings: refused before anything is timed
        bench.main(["run", "--timings", "4", "--results", str(tmp_path / "none")])
    assert exit_.value.code == 2 and not (tmp_path / "none").exists()


def test_the_fit_spread_on_the_page_is_the_committed_timings_replayed():
    """docs/gates.md 0c quotes each kind's share from benchmarks/fit_spread.py's table, which is made again here from
    the committed timings (the kept teacher's probes, replayed through fit_latency); the README is that table."""
    bench = load_benchmark("fit_spread")
    made = bench.table(bench.load_model(str(bench.ROOT / "teacher")), bench.RESULTS, singles=False)
    readme = (bench.RESULTS / "README.md").read_text().splitlines()
    assert all(line in readme for line in made.splitlines())  # the README's rows but "one timing" (its replays)
    rows = {}
    for line in made.splitlines()[2:]:
        cells = line.strip("| ").split(" | ")
        rows[(cells[0], cells[1].split(" (")[0])] = cells[2:]
    page = (bench.ROOT / "docs" / "gates.md").read_text()
    section = page[page.index("**How far a measured fit moves"):page.index("- **A run's fit on this machine")]
    quoted = [line.strip("| ").split(" | ") for line in section.splitlines()
              if line.startswith(("| busy | ", "| quiet | ", "| - | the kept table"))]
    labels = {"a run (three timings at most)": "a run", "the median of all 15 timings": "every timing",
              "a run at 5% (15 timings at most)": "5% tolerance", "the kept table (another day)": "the kept table"}
    assert len(quoted) == 7
    for cells in quoted:
        assert cells[2:] == rows[(cells[0], labels[cells[1]])], cells
    # the guide's sentence: the widest decoder layer share of a run's fit, and the fits at 5%
    guide = " ".join((bench.ROOT / "docs" / "guide" / "speed_targets.md").read_text().split())
    widest = max((rows[(load, "a run")][10].split("-")[1] for load in ("busy", "quiet")), key=float)
    assert f"anywhere from 0 to {round(float(widest))}% of the latency" in guide
    tight = [rows[(load, "5% tolerance")] for load in ("busy", "quiet")]
    assert f"took {tight[0][1]} and {tight[1][1]} timings and missed their probes by {tight[0][2]} and {tight[1][2]}" \
        in guide


def test_the_ceiling_runs_record_the_multiplier_and_compose_the_default_s_gated_phase(tmp_path):
    """benchmarks/ceiling.py: the default's gated phase (its pruning, the kept table or the busy fit kept beside the
    records), a trajectory read from the run's own log, and the table's cells from the records."""
    bench = load_benchmark("ceiling")
    default = compose_train(tmp_path)
    for name, (steps, overrides) in bench.RUNS.items():
        run = compose_train(tmp_path, *bench.args(name, tmp_path))
        assert run.gated_steps == steps and run.pruning.target_ceiling == ("pruning.target_ceiling=true" in overrides)
        table = str(bench.BUSY_FIT) if name.startswith("busy_fit") else default.pruning.workload.table
        assert run.pruning.workload.table == table and run.pruning.target_latency == default.pruning.target_latency
        # the default of 2026-12-06, as the records were made: layers settled at step 100, no widths held
        assert run.pruning.settle_layers_at == 100 and run.pruning.settle_widths_at is None
        assert {**run.pruning, "settle_layers_at": 1, "settle_widths_at": 200, "target_ceiling": False,
                "workload": default.pruning.workload} == default.pruning
    log = tmp_path / "run" / "csv"
    log.mkdir(parents=True)
    log.joinpath("metrics.csv").write_text("step,train/expected_latency,train/target_latency,train/lambda1,val/bleu\n"
                                           "99,0.7,0.67,2.5,\n100,,,,12.0\n299,0.6,0.67,-1.25,\n")
    assert bench.trajectory(tmp_path / "run") == [
        {"step": 99, "target": 0.67, "expected": 0.7, "lambda1": 2.5},
        {"step": 299, "target": 0.67, "expected": 0.6, "lambda1": -1.25}]
    results = tmp_path / "results"
    results.mkdir()
    budget = {"latency": {"expected_size_kept": 0.6543, "plan_rule": "expected_size"}}
    for name, lam in (("base450", -1.25), ("ceil450", 0.0)):
        command = " ".join(bench.args(name, tmp_path))
        (results / f"{name}.json").write_text(json.dumps({"command": command, "budget": budget, "trajectory": [
            {"step": 99, "target": 0.67, "expected": 0.7, "lambda1": 2.5},
            {"step": 299, "target": 0.67, "expected": 0.6, "lambda1": lam}]}))
    rows = [line for line in bench.table(results).splitlines() if line.startswith("| as") or line.startswith("| the")]
    cells = "| - | - | - | - | 0.654 | expected_size |"
    assert rows == [f"| as the default, the kept table | 0.700 / 2.5 | - | - | 0.600 / -1.2 {cells}",
                    f"| the target a ceiling, the kept table | 0.700 / 2.5 | - | - | 0.600 / 0.0 {cells}"]


def test_the_ceiling_page_table_is_the_committed_records():
    """docs/gates.md 0k: the table is remade from the records, and the records say what the page says of them."""
    bench = load_benchmark("ceiling")
    text = bench.PAGE.read_text()
    block = text.split("<!-- ceiling table -->\n")[1].split("\n<!-- end ")[0]
    assert block == bench.table(bench.RESULTS).strip() + "\n", "run benchmarks/ceiling.py table"
    base, ceiling = (json.loads((bench.RESULTS / f"{n}.json").read_text())["trajectory"]
                     for n in ("base450", "ceil450"))
    at = {p["step"]: p for p in base}
    assert at[299]["lambda1"] < 0 and at[339]["expected"] > at[299]["expected"] + 0.1  # wound below zero, reopened
    assert min(p["lambda1"] for p in ceiling) >= 0
    late = [p["expected"] for p in ceiling if p["step"] >= 199]
    assert max(late) - min(late) < 0.02 and max(late) <= 0.67  # held under the target from step 199 on
    trough = [at[s] for s in range(139, 300, 20)]
    page = " ".join(text.split())
    assert (f"From step 139 to 299 the expected cost held {min(p['expected'] for p in trough):.3f}-"
            f"{max(p['expected'] for p in trough):.3f}, while lambda1 fell from {at[139]['lambda1']:.1f} to "
            f"{at[299]['lambda1']:.1f}").replace(", while", ", 2.8-5.2% under the target, while") in page
    assert f"{at[339]['expected']:.3f} at step 339" in page and f"{at[439]['expected']:.3f} at step 439" in page


def test_the_busy_fit_with_a_ceiling_meets_the_target_the_pair_missed():
    """docs/gates.md 0k: the measured_once pair's busy fit, kept as a table, prices the ceiling's run; it ends
    within 3% of the target with the mask shipped, where the pair ended 13% over and filled."""
    bench, pairs = load_benchmark("ceiling"), load_benchmark("plan_repro")
    record = json.loads((bench.RESULTS / "busy_fit_ceil300.json").read_text())
    pair = json.loads((pairs.RESULTS / "first_layers_measured_once_busy.json").read_text())
    fit = json.loads(bench.BUSY_FIT.read_text())
    assert fit["coefficients"] == pair["costs"]["coefficients"] and fit["base"] == pair["costs"]["base"]
    assert f"pruning.workload.table={bench.BUSY_FIT.relative_to(bench.ROOT)}" in record["command"]
    ours, theirs = record["budget"]["latency"], pair["budget"]["latency"]
    assert abs(ours["expected_kept"] / 0.67 - 1) < 0.03 and abs(ours["expected_size_kept"] / 0.67 - 1) < 0.03
    assert ours["plan_rule"] == "expected_size" and theirs["plan_rule"] == "latency"
    assert theirs["expected_kept"] > 0.67 * 1.1
    later = [p["expected"] for p in record["trajectory"] if p["step"] >= 99]
    page = " ".join(bench.PAGE.read_text().split())
    assert (f"the cost ended at {ours['expected_kept']:.3f}, 0.2% under the target, where the pair ended at "
            f"{theirs['expected_kept']:.3f}") in page
    assert f"the cost stayed within {min(later):.3f}-{max(later):.3f}" in page


def test_the_busy_pair_s_trajectory_is_as_the_page_says():
    """docs/gates.md 0k: the measured_once busy run fell under the target after the ramp, its lambda1 went below
    zero by step 179, and the gates reopened at step 239."""
    pairs, page = load_benchmark("plan_repro"), " ".join(load_benchmark("ceiling").PAGE.read_text().split())
    record = json.loads((pairs.RESULTS / "first_layers_measured_once_busy.json").read_text())
    at = {p["step"]: p for p in record["trajectory"]}
    assert at[159]["lambda1"] > 0 > at[179]["lambda1"] and at[239]["expected"] > at[219]["expected"] + 0.1
    assert (f"fell further under the target after the ramp ({at[99]['expected']:.3f} at step 99), so lambda1 went "
            f"below zero earlier (by step 179) and the gates reopened at step 239 ({at[219]['expected']:.3f} at step "
            f"219, {at[239]['expected']:.3f} at 239)") in page


def test_the_ceiling_seeds_on_the_status_are_the_cells():
    """docs/gates.md's status: the ceiling's recovered seeds as the cells' records have them."""
    bench = load_benchmark("recovery")
    page = " ".join(bench.GATES_PAGE.read_text().split())
    scores = {}
    for seed in (1234, 1, 2):
        cell = json.loads((bench.RESULTS / f"choose_gates_bottom2_ceiling_0.67_s{seed}_1000_lr0.002.json").read_text())
        assert "pruning.target_ceiling=true" in cell["export_command"]
        scores[seed] = cell["test_bleu_at"]["1000"]
    assert f"{scores[1234]:.2f}, {scores[1]:.2f} and {scores[2]:.2f} test BLEU after 1,000 steps" in page
    random2 = json.loads((bench.RESULTS / "choose_random_0.67_s2_1000_lr0.002.json").read_text())["test_bleu_at"]
    assert scores[2] < random2["1000"] and f"below random structures at seed 2 ({random2['1000']:.2f})" in page


def test_the_ceiling_at_0_55_is_as_the_page_says():
    """docs/gates.md 0k: gates_bottom1_ceiling's gated phases (costs, lambda1, what they kept) and its recovery, as
    the three cells' records keep them."""
    bench = load_benchmark("recovery")
    page = " ".join(bench.GATES_PAGE.read_text().split())
    cells = [json.loads((bench.RESULTS / f"choose_gates_bottom1_ceiling_0.55_s{seed}_1000_lr0.002.json").read_text())
             for seed in (1234, 1, 2)]
    phases = [c["gated_phase"] for c in cells]
    at = [{p["step"]: p for p in phase["trajectory"]} for phase in phases]

    def span(values, fmt="{:.1f}"):
        return f"{fmt.format(min(values))}-{fmt.format(max(values))}"

    under = [100 * (0.55 - p["budget"]["latency"]["expected_kept"]) / 0.55 for p in phases]
    assert min(under) > 3 and f"the costs end {span(under)}% under the target" in page
    assert f"lambda1 was at {span([a[119]['lambda1'] for a in at])} (step 119)" in page
    assert all(a[279]["lambda1"] == 0 < a[259]["lambda1"] for a in at) and "came down to 0 at step 279" in page
    assert f"its cost was already {span([a[19]['expected'] for a in at], '{:.3f}')}" in page
    assert f"the ceiling's {span([a[19]['lambda1'] for a in at])};" in page
    kept = [p["kept"] for p in phases]
    assert all(k["decoder"] == 0 and k["decoder_layer"] == 1 and k["encoder"] == 23 for k in kept)
    assert f"{span([k['cross'] for k in kept], '{}')} cross heads" in page
    assert f"{span([k['decoder_ffn'] for k in kept], '{}')} decoder FFN units" in page
    assert f"23 of 24 heads and {span([k['encoder_ffn'] for k in kept], '{}')} FFN units" in page
    assert all(round(p["gated_val_bleu"] - p["export_val_bleu"], 2) == 0 for p in phases)
    scores = [c["test_bleu_at"]["1000"] for c in cells]
    import statistics

    assert f"recovered to {statistics.fmean(scores):.2f} ± {statistics.stdev(scores):.2f} test BLEU" in page


def _section_and_cells(section: str, until: str, target: str = "0.55"):
    """(the page's section ``section`` up to ``until``, whitespace folded; a function giving a start's three
    choose cells at ``target`` after 1,000 steps, by seed)."""
    bench = load_benchmark("recovery")
    page = " ".join(bench.GATES_PAGE.read_text().split())

    def cells(start):
        return [json.loads((bench.RESULTS / f"choose_{start}_{target}_s{seed}_1000_lr0.002.json").read_text())
                for seed in bench.SEEDS]

    return page.split(f"## {section}.")[1].split(f"## {until}.")[0], cells


def test_the_fill_at_0_55_held_or_not_is_as_the_page_says():
    """docs/gates.md 0l: gates_bottom1_fill and gates_bottom1_widths, their gated phases' criteria and their scores
    against random structures and even layers by seed, as the records keep them."""
    import statistics

    bench = load_benchmark("recovery")
    section, cells = _section_and_cells("0l", "0m")

    fill, widths = cells("gates_bottom1_fill"), cells("gates_bottom1_widths")
    gaps = [c["gated_phase"]["gated_val_bleu"] - c["gated_phase"]["export_val_bleu"] for c in fill]
    assert min(gaps) > 0.5 and f"{min(gaps):.2f}-{max(gaps):.2f} validation BLEU below the gated model" in section
    under = [100 * (0.55 - c["gated_phase"]["budget"]["latency"]["expected_kept"]) / 0.55 for c in fill]
    assert 2 <= min(under) and max(under) <= 3 and f"costs {min(under):.1f}-{max(under):.1f}% under" in section
    for c in widths:  # both criteria: every cost at the target, the mask shipped is the model validated
        costs = c["gated_phase"]["budget"]["latency"]
        assert all(abs(costs[k] - 0.55) / 0.55 < 0.001 for k in ("expected_kept", "binary_kept", "plan_kept"))
        assert round(c["gated_phase"]["gated_val_bleu"] - c["gated_phase"]["export_val_bleu"], 2) == 0
        assert c["gated_phase"]["kept"]["decoder"] == 2 and c["gated_phase"]["kept"]["cross"] == 5
    for start, records in (("gates_bottom1_fill", fill), ("gates_bottom1_widths", widths)):
        scores = [c["test_bleu_at"]["1000"] for c in records]
        table = bench.choose(bench.RESULTS, chosen=start)[0.55]
        assert f"{statistics.fmean(scores):.2f} ± {statistics.stdev(scores):.2f}" in section
        for rival in ("random", "even_layers"):
            apart = [table[start]["by_seed"][s] - table[rival]["by_seed"][s] for s in bench.SEEDS]
            assert f"{statistics.fmean(apart):+.2f} on average" in section, (start, rival)
            if rival == "random":
                assert min(apart) > 0 and ", ".join(f"{d:+.2f}" for d in apart[:2]) in section
    apart = [table["gates_bottom1_widths"]["by_seed"][s] - table["even_layers"]["by_seed"][s] for s in bench.SEEDS]
    assert f"{statistics.fmean(apart):.2f} ± {statistics.stdev(apart):.2f}" in section


def test_the_widths_speed_and_the_fit_s_additivity_are_as_the_page_says():
    """docs/gates.md 0l and 0h (2026-12-07): gates_bottom1_widths' speed beside even layers and random structures,
    over the mean of the teacher and its copy, both sets of fits against the same shapes, and the additivity table,
    from the committed measurement files."""
    import statistics

    from gatedprune.costs.latency import fit_error

    bench = load_benchmark("recovery")
    per = load_benchmark("fit_per_runtime")
    page = " ".join(bench.GATES_PAGE.read_text().split())
    widths_section = page.split("## 0l.")[1].split("## 0m.")[0]
    speeds = bench.pooled_speeds(bench.RESULTS, bench.POOLED["speed_2026-12-07"])
    widths, even, random_ = (speeds[(0.55, s)] for s in ("gates_bottom1_widths", "even_layers", "random"))

    def x(start, key):
        return f"{statistics.mean(start[key]):.2f}x"

    b1, b32, c1, c32 = bench.SPEED_KEYS
    assert len(widths[b1]) == 3 and (
        f"{x(widths, b1)} the teacher's speed in `generate()` at batch 1 ({min(widths[b1]):.2f}-{max(widths[b1]):.2f}x "
        f"over the three seeds), {x(widths, b32)} at batch 32, {x(widths, c1)} and {x(widths, c32)} in CTranslate2 "
        "int8 at batch 1 and 32") in widths_section
    assert (f"measured {x(even, b1)}, {x(even, b32)}, {x(even, c1)} and {x(even, c32)} (one shape, one timing"
            in widths_section and len(even[b1]) == 1)
    assert f"measured as fast: {x(random_, b1)}, {x(random_, b32)}, {x(random_, c1)} and {x(random_, c32)}" \
        in widths_section
    faster = statistics.mean(widths[b1]) / statistics.mean(even[b1]) - 1
    assert f"at the same test BLEU it is {100 * faster:.0f}% faster in `generate()`" in widths_section
    floor = json.loads((bench.RESULTS / "speed_2026-12-07.json").read_text())["noise_floor"]
    assert f"{min(floor.values()):.2f}-{max(floor.values()):.2f}x" in widths_section
    # 0h: each set of fits against the same eight shapes, their own probes, and the additivity table
    section = page.split("## 0h.")[1].split("## 1.")[0]
    folder = per.RESULTS / "speed_2026-12-07"
    row = ["| timed to 20% (three timings at most) |", "| timed to 5% (`generate()`) or 10% (CTranslate2) |"]
    for label, results in zip(row, (folder / "tolerance_0.2", folder)):
        said = json.loads((results / "results_speed_2026-12-07.json").read_text())["summary"]
        cells = [f"{said[k]['within']} of {said[k]['shapes']}, {100 * said[k]['median']:+.0f}%" for k in
                 bench.SPEED_KEYS]
        assert f"{label} {' | '.join(cells)} |" in section, cells
        errors = [fit_error(json.loads(per.fit_path(results, k).read_text())["probes"]) for k in bench.SPEED_KEYS]
        assert ", ".join(f"{100 * e:.1f}%" for e in errors[:-1]) + f" and {100 * errors[-1]:.1f}%" in section
    tight = json.loads((folder / "results_speed_2026-12-07.json").read_text())["rows"]
    at_055 = [per.off(r, c32) for r in tight if r["model"].split(" at ")[1].startswith("0.55")
              and not r["model"].startswith("even_layers")]
    assert f"by {-100 * max(at_055):.0f}-{-100 * min(at_055):.0f}% here" in section
    for key in per.WORKLOADS:
        path = per.fit_path(folder, key)
        rows = json.loads(path.with_name("additivity_" + path.name).read_text())["rows"]
        off, fitted = per.additivity_off(rows), per.priced(rows)
        ms = {r["probe"]: 1e3 * statistics.median(r["seconds"]) for r in rows}
        own = max(abs(off[r["probe"]]) for r in rows if r["fitted"])
        combined = [off[r["probe"]] for r in rows if not r["fitted"]]
        cells = (f"| {key} | {100 * own:.0f}% | {100 * min(combined):+.0f}% to {100 * max(combined):+.0f}% (median "
                 f"{100 * statistics.median(combined):+.0f}%) | {ms['every width 0.5']:.1f} / "
                 f"{1e3 * fitted['every width 0.5']:.1f} ms | {ms['every width 0.1, one decoder layer']:.1f} / "
                 f"{1e3 * fitted['every width 0.1, one decoder layer']:.1f} ms |")
        assert cells in section, cells
        if key == c32:
            half = min(ms[p] for p in ms if p.endswith(" 0.5") and not p.startswith("every "))
            assert (f"halving one kind alone saves at most {ms['dense'] - half:.1f} ms of the dense model's "
                    f"{ms['dense']:.1f} ms. Halving every width at once saves {ms['dense'] - ms['every width 0.5']:.1f}"
                    f" ms, where the fit expects {1e3 * (fitted['dense'] - fitted['every width 0.5']):.1f} ms") in section
            status_c32 = (ms["dense"] - ms["every width 0.5"], 1e3 * (fitted["dense"] - fitted["every width 0.5"]))
    # the status at the top of the page quotes both
    status = page.split("## 0.")[0]
    assert (f"it runs at {x(widths, b1)} the teacher's speed in `generate()` at batch 1, even layers at {x(even, b1)} "
            f"(one shape, one timing) and random structures at {x(random_, b1)}: at the same BLEU as even layers, "
            f"{100 * faster:.0f}% faster") in status
    said = json.loads((folder / "results_speed_2026-12-07.json").read_text())["summary"]
    loose = json.loads((folder / "tolerance_0.2" / "results_speed_2026-12-07.json").read_text())["summary"][c32]
    assert all(said[k]["within"] == said[k]["shapes"] == 8 for k in (b1, b32))
    assert f"CTranslate2 int8 at batch 1 for {said[c1]['within']} of 8" in status
    assert (f"under-predicted by {-100 * said[c32]['median']:.0f}% at the median ({said[c32]['within']} of 8 within "
            f"15%; {loose['within']} of 8 and {100 * loose['median']:+.0f}% with fits timed to 20%)") in status
    assert (f"halving every width at once saved {status_c32[0]:.1f} ms where the one-kind probes' fit expected "
            f"{status_c32[1]:.1f} ms") in status
    # the depth compared by hand at 0.67 (one seed), as the status says
    one, two = (json.loads((bench.RESULTS / f"choose_gates_{c}_late_0.67_s1234_1000_lr0.002.json").read_text())
                ["test_bleu_at"]["1000"] for c in ("bottom1", "bottom2"))
    assert one < two and f"scored {one:.2f} against {two:.2f} after 1,000 steps" in status


def test_distillation_while_pruning_at_0_55_is_as_the_page_says():
    """docs/gates.md 0m: gates_bottom1_widths_kd's gated phases (criteria 1 and 2, what they keep, their validation
    BLEU before recovery) and its recovery against the same protocol without the teacher, even layers and random
    structures by seed, as the records keep them."""
    import statistics

    bench = load_benchmark("recovery")
    section, cells = _section_and_cells("0m", "0n")
    page = " ".join(bench.GATES_PAGE.read_text().split())

    kd, plain = cells("gates_bottom1_widths_kd"), cells("gates_bottom1_widths")
    assert all("pruning.distill.alpha=0.5" in c["export_command"] for c in kd)
    assert not any("distill" in c["export_command"] for c in plain)
    for c in kd:  # both criteria: every cost at the target, the mask shipped is the model validated
        costs = c["gated_phase"]["budget"]["latency"]
        assert all(abs(costs[k] - 0.55) / 0.55 < 0.001 for k in ("expected_kept", "binary_kept", "plan_kept"))
        assert round(c["gated_phase"]["gated_val_bleu"] - c["gated_phase"]["export_val_bleu"], 2) == 0
        assert c["gated_phase"]["kept"]["decoder"] == 1 and c["gated_phase"]["kept"]["cross"] == 5

    def span(values):
        return f"{min(values):.2f}-{max(values):.2f}"

    assert (f"the export scores {span([c['gated_phase']['export_val_bleu'] for c in kd])} validation BLEU, against "
            f"{span([c['gated_phase']['export_val_bleu'] for c in plain])} without distillation") in section
    units = sorted({c["gated_phase"]["kept"]["decoder_ffn"] for c in kd})
    assert f"1 self-attention head and {units[0]}-{units[-1]} decoder FFN units" in section
    table = bench.choose(bench.RESULTS, chosen="gates_bottom1_widths_kd")[0.55]
    scores = [table["gates_bottom1_widths_kd"]["by_seed"][s] for s in bench.SEEDS]
    assert scores == [c["test_bleu_at"]["1000"] for c in kd]
    assert f"it scores {statistics.fmean(scores):.2f} ± {statistics.stdev(scores):.2f} test BLEU" in section
    plain_scores = [c["test_bleu_at"]["1000"] for c in plain]
    assert f"against {statistics.fmean(plain_scores):.2f} ± {statistics.stdev(plain_scores):.2f} for " in section

    def apart(rival):
        differences = [a - table[rival]["by_seed"][s] for a, s in zip(scores, bench.SEEDS)]
        return statistics.fmean(differences), ", ".join(f"{d:+.2f}" for d in differences), min(differences)

    mean, by_seed, _ = apart("gates_bottom1_widths")
    assert mean < 0 and f": {mean:+.2f} on the same seeds ({by_seed} by seed)" in section
    mean, by_seed, _ = apart("even_layers")
    assert mean < 0 and f"Against even layers it is {mean:+.2f} on average ({by_seed} by seed)" in section
    mean, by_seed, least = apart("random")
    assert least > 0 and f"Against random structures it is {mean:+.2f} on average ({by_seed}), above them at every " \
        "seed" in section
    # and the page's first lines, and its ranking of what gatedprune lacks, say the same
    status = page.split("## 0.")[0]
    assert f"gains nothing: {statistics.fmean(scores):.2f} ± {statistics.stdev(scores):.2f} after 1,000 steps, " \
        f"{apart('gates_bottom1_widths')[0]:+.2f} against the same protocol without the teacher, " \
        f"{apart('even_layers')[0]:+.2f} against even layers and {apart('random')[0]:+.2f} against random" in status
    assert f"no gain either ({apart('gates_bottom1_widths')[0]:+.2f} against the same protocol without it" in page
    guide = " ".join((bench.ROOT / "docs" / "guide" / "method.md").read_text().split())
    assert (f"recovered to {statistics.fmean(scores):.2f} ± {statistics.stdev(scores):.2f} test BLEU over three seeds, "
            f"against {statistics.fmean(plain_scores):.2f} ± {statistics.stdev(plain_scores):.2f} without it") in guide


def test_the_widths_held_at_0_67_are_as_the_page_says():
    """docs/gates.md 0n: gates_bottom2_widths (gates_bottom1_widths with two decoder layers) at 0.67, its gated
    phases (criteria 1 and 2, what they keep, their exports before recovery) and its recovery against the default of
    2026-12-06, random structures and even layers by seed, as the records keep them; the t statistics it quotes."""
    import math
    import statistics

    bench = load_benchmark("recovery")
    page = " ".join(bench.GATES_PAGE.read_text().split())
    section, cells = _section_and_cells("0n", "0c", target="0.67")
    held, late = cells("gates_bottom2_widths"), cells("gates_bottom2_late")
    for c in held:  # both criteria: every cost at the target, the mask shipped is the model validated
        costs = c["gated_phase"]["budget"]["latency"]
        assert all(abs(costs[k] - 0.67) / 0.67 < 0.001 for k in ("expected_kept", "binary_kept", "plan_kept"))
        assert round(c["gated_phase"]["gated_val_bleu"] - c["gated_phase"]["export_val_bleu"], 2) == 0
        assert c["kept_layers"]["decoder"] == 2 and "pruning.settle_widths_at=200" in c["export_command"]

    def span(values, digits=2):
        return f"{min(values):.{digits}f}-{max(values):.{digits}f}"

    # gates_bottom2_late's gated phases are recorded by benchmarks/gates.py (0j)
    phases = [json.loads((load_benchmark("gates").RESULTS / f"bottom2_late_300_0.67_s{seed}.json").read_text())
              for seed in bench.SEEDS]
    assert (f"the export scores {span([c['gated_phase']['export_val_bleu'] for c in held])} validation BLEU, against "
            f"{span([p['export']['val_bleu'] for p in phases])} for `gates_bottom2_late`'s exports") in section
    under = [100 * (0.67 - p[k]) / 0.67 for p in phases for k in ("expected_kept", "binary_kept", "plan_kept")]
    assert f"`gates_bottom2_late` ended {span(under, 1)}% under the target, this protocol at it" in section
    unspent = sum(100 * (0.67 - p["plan_kept"]) / 0.67 for p in phases) / 3
    assert f"it spends the {unspent:.1f}% of the latency that `gates_bottom2_late` left unspent" in section
    kept = [c["gated_phase"]["kept"] for c in held]
    heads = {kind: {k[kind] for k in kept} for kind in ("encoder", "decoder", "cross")}
    assert all(len(v) == 1 for v in heads.values()) and heads["encoder"] == {24}  # every encoder head
    assert (f"every encoder head, {span([k['encoder_ffn'] for k in kept], 0)} encoder FFN units, "
            f"{heads['decoder'].pop()} decoder heads, {heads['cross'].pop()} "
            f"cross heads and {span([k['decoder_ffn'] for k in kept], 0)} decoder FFN units "
            f"({span([c['params'] / 1e6 for c in held])} M parameters)") in section
    assert {p["export"]["kept"]["encoder"] for p in phases} == {23}
    assert (f"23 encoder heads and {span([p['export']['kept']['decoder_ffn'] for p in phases], 0)} decoder FFN units "
            f"({span([c['params'] / 1e6 for c in late])} M)") in section
    table = bench.choose(bench.RESULTS, chosen="gates_bottom2_widths")[0.67]
    scores = [table["gates_bottom2_widths"]["by_seed"][s] for s in bench.SEEDS]
    assert scores == [c["test_bleu_at"]["1000"] for c in held]
    assert f"After 1,000 steps it scores {statistics.fmean(scores):.2f} ± {statistics.stdev(scores):.2f} test BLEU" \
        in section
    for rival, label in (("gates_bottom2_late", "against `gates_bottom2_late`, the default of 2026-12-06"),
                         ("random", "against random structures"), ("even_layers", "against even layers")):
        apart = [a - table[rival]["by_seed"][s] for a, s in zip(scores, bench.SEEDS)]
        assert min(apart) > 0  # above it at every seed
        mean = statistics.fmean(apart)
        assert f"{mean:+.2f} {label} ({', '.join(f'{d:+.2f}' for d in apart)})" in section, rival
        if rival != "gates_bottom2_late":  # the paired t on two degrees of freedom, and its two-sided p
            t = mean / (statistics.stdev(apart) / math.sqrt(3))
            p = 1 - t / math.sqrt(t * t + 2)
            assert f"{t:.1f} against {'random structures' if rival == 'random' else 'even layers'}, p about {p:.2f}" \
                in section.replace("paired t of ", ""), (rival, t, p)
    # the page's first lines say the same
    status = page.split("## 0.")[0]
    leads = {r: statistics.fmean(a - table[r]["by_seed"][s] for a, s in zip(scores, bench.SEEDS))
             for r in ("random", "even_layers", "gates_bottom2_late")}
    assert (f"{statistics.fmean(scores):.2f} ± {statistics.stdev(scores):.2f} test BLEU after 1,000 steps, above random "
            f"structures ({leads['random']:+.2f}), even layers ({leads['even_layers']:+.2f}) and the default of "
            f"2026-12-06 ({leads['gates_bottom2_late']:+.2f}) at every seed") in status


def test_the_speed_stage_times_each_plan_once_beside_the_teacher_and_both_predictions(tmp_path, capsys):
    """``plan_repro.py speed``: the exports of the recorded runs (one per plan), the teacher and its copy timed by the
    fit's own timer in one call; each measured speed-up beside its run's own prediction and the kept table's."""
    import copy

    from gatedprune.costs import table as latency_table
    from gatedprune.surgery.cut import prune_heads
    from helpers import FAKE_BASE, FAKE_COSTS, bart_structures, tiny_bart3

    bench = load_benchmark("plan_repro")
    results, runs = tmp_path / "results", tmp_path / "runs"
    results.mkdir()
    teacher = tiny_bart3()
    smaller = prune_heads(copy.deepcopy(teacher), {"model.decoder.layers": [0]})  # one decoder layer of three
    plans = {"table": ({"layers model.decoder.layers": [0]}, smaller), "measured": ({"a": [1]}, teacher)}
    for fit, (plan, model) in plans.items():
        for load in bench.LOADS:
            name = bench.name_of("first_layers", fit, load)
            record = {"name": name, "fit": fit, "load": load, "plan": plan, "costs": {"fit_error": 0.03},
                      "predicted": {"speed_up": 1.5 if fit == "table" else 1.0}}
            (results / f"{name}.json").write_text(json.dumps(record))
            if not (fit == "measured" and load == "quiet"):  # an export gone from the runs: not timed
                model.save_pretrained(runs / name / "pruned")
    (results / f"{bench.name_of('first_layers', 'measured_5pct', 'busy')}.json").write_text(
        json.dumps({"refused": "error: ..."}))  # a refused run has no plan and no export
    once = bench.name_of("first_layers", "measured_once", "busy")  # another fit, the table's plan, its export gone
    (results / f"{once}.json").write_text(json.dumps({"name": once, "fit": "measured_once", "plan": plans["table"][0],
                                                      "costs": {"fit_error": 0.04}, "predicted": {"speed_up": 1.4}}))
    calls = []

    def timer(models, workload):
        calls.append(len(models))
        assert workload.repeats == bench.SPEED_REPEATS and workload.batch == 1 and workload.threads == 1
        return fake_timer(models, workload)

    out = bench.speed(results, runs, lambda: copy.deepcopy(teacher), timer)
    # the teacher, its copy, the measured pair's busy export and the table's plan once (both of its runs and the
    # measured_once run ship it); a row per pair and plan, each with its own fit's prediction
    assert calls == [4] and [r["name"] for r in out["rows"]] == ["first_layers_widths_measured_busy", once,
                                                                   "first_layers_widths_table_busy"]
    assert [r["own_fit"] for r in out["rows"]] == [1.0, 1.4, 1.5]
    assert out["rows"][1]["measured"] == out["rows"][2]["measured"] and out["rows"][1]["fit_error"] == 0.04
    seconds = {n: FAKE_BASE + sum(FAKE_COSTS[k] * c for k, c in bart_structures(m).items())
               for n, m in (("teacher", teacher), ("smaller", smaller))}
    _, kept, _ = latency_table.read(bench.recovery.TABLE)

    def by_table(model):
        counts = bart_structures(model)
        return kept.base + sum(c * counts[k] for k, c in kept.coefficients.items())

    row = out["rows"][2]
    assert row["measured"] == pytest.approx(seconds["teacher"] / seconds["smaller"]) and row["own_fit"] == 1.5
    assert row["kept_table"] == pytest.approx(by_table(teacher) / by_table(smaller)) and row["kept_table"] > 1
    assert out["rows"][0]["measured"] == pytest.approx(1.0) and out["noise_floor"] == pytest.approx(1.0)
    assert json.loads((results / "speed_first_layers.json").read_text()) == out
    text = bench.speed_table(out)
    assert (f"| first_layers_widths_table_busy | 3.0% | {row['measured']:.2f}x | 1.50x "
            f"({100 * (1.5 / row['measured'] - 1):+.0f}%) |") in text
    with pytest.raises(SystemExit, match="speed: no export of a recorded first_layers run in"):
        bench.speed(results, tmp_path / "elsewhere", lambda: teacher, timer)
    # a repeat keeps its own record, its command naming it
    again = bench.speed(results, runs, lambda: copy.deepcopy(teacher), timer, name="speed_first_layers_b.json")
    assert again["command"].endswith("--protocol first_layers --name speed_first_layers_b.json")
    assert json.loads((results / "speed_first_layers_b.json").read_text()) == again
    for bad in (["table", "--name", "speed_x.json"], ["speed", "--name", "../speed_x.json"],
                ["speed", "--name", "x.json"]):
        with pytest.raises(SystemExit) as caught:
            bench.main([*bad, "--results", str(results)])
        assert caught.value.code == 2
    assert f"error: --name {bad[-1]}; allowed: with the speed stage, a file name speed_*.json" in \
        capsys.readouterr().err


def test_the_joint_probes_fits_per_runtime_are_as_the_page_says():
    """docs/gates.md 0h, "The joint probes on this machine": the fits with the joint probes and the same timings'
    one-kind fits against the measurement of 2026-12-07's late evening, as their results files say; each one-kind
    fit is the joint fit's 15 one-kind probes fitted again."""
    bench = load_benchmark("recovery")
    per = load_benchmark("fit_per_runtime")
    page = " ".join(bench.GATES_PAGE.read_text().split())
    section = page.split("**The joint probes on this machine")[1].split("<!-- end fit table -->")[0]
    folder = per.RESULTS / "speed_2026-12-07_joint"
    name = "results_speed_2026-12-07_joint.json"
    joint, one = _joint_and_one_kind_fits_as_the_page_says(section, folder, name, "")
    b1, b32, c1, c32 = bench.SPEED_KEYS
    assert joint[c32]["within"] == joint[c1]["within"] == joint[b1]["within"] == 11 > joint[b32]["within"]
    assert (f"{joint[b32]['within']} of 11 within 15%, over-predicted by {100 * joint[b32]['median']:.0f}% at the "
            f"median**, against {one[b32]['within']} of 11 and {100 * one[b32]['median']:+.0f}% without them"
            ) in section
    assert f"against {one[c32]['within']} of 11 ({100 * one[c32]['median']:+.0f}%) from the same timings" in section
    floor = json.loads((bench.RESULTS / "speed_2026-12-07_joint.json").read_text())["noise_floor"]
    assert f"the noise floor (a copy of the teacher) was {min(floor.values()):.2f}-{max(floor.values()):.2f}x" \
        in section
    status = page.split("## 0.")[0]
    assert (f"(11 of 11 at each, against {one[c32]['within']} of 11 from the same timings without them)" in status
            and one[c1]["within"] == one[c32]["within"])
    assert (f"only for {joint[b32]['within']} of 11 (over-predicted by {100 * joint[b32]['median']:.0f}% at the "
            f"median; {one[b32]['within']} of 11 without them)") in status


def test_the_three_round_measurement_and_its_fits_are_as_the_page_says():
    """docs/gates.md 0h, "Measured again in three rounds": the fits of 2026-12-08 against that measurement (each
    speed-up the median of three rounds), as their results files say; the rounds' own spread, and how far the same
    shapes moved from the measurement of 2026-12-07's late evening, from the two measurements' files."""
    import statistics

    bench = load_benchmark("recovery")
    per = load_benchmark("fit_per_runtime")
    raw = bench.GATES_PAGE.read_text()
    page = " ".join(raw.split())
    section = page.split("**Measured again in three rounds (2026-12-08).**")[1].split("<!-- end fit table -->")[0]
    folder = per.RESULTS / "speed_2026-12-08"
    name = "results_speed_2026-12-08.json"
    # the table below the section is the results folder's, whole
    block = raw.split("<!-- fit table speed_2026-12-08 -->\n")[1].split("<!-- end fit table -->")[0]
    assert block.strip() == (folder / "README_speed_2026-12-08.md").read_text().split("\n\n", 1)[1].strip()
    summaries = _joint_and_one_kind_fits_as_the_page_says(section, folder, name, ", 2026-12-08")
    # each speed-up kept is the median of its three rounds; how far the rounds of one shape spread
    measurement = json.loads((bench.RESULTS / "speed_2026-12-08.json").read_text())
    assert measurement["rounds"] == 3 and measurement["repeats"] == 9
    spread = {}
    for key in bench.SPEED_KEYS:
        for timed in measurement["speeds"].values():
            assert timed["speed"][key] == statistics.median(r[key] for r in timed["rounds"])
        spread[key] = [max(r[key] for r in t["rounds"]) / min(r[key] for r in t["rounds"]) - 1
                       for t in measurement["speeds"].values()]

    def listed(values):
        return ", ".join(f"{100 * v:.0f}%" for v in values[:-1]) + f" and {100 * values[-1]:.0f}%"

    medians = [statistics.median(spread[k]) for k in bench.SPEED_KEYS]
    assert f"spread by {listed(medians)} (highest over lowest" in section
    assert f"by up to {listed([max(spread[k]) for k in bench.SPEED_KEYS])}" in section
    rounds = [v for r in measurement["noise_floor_rounds"] for v in r.values()]
    assert f"The noise floor of one round (the teacher's copy) was {min(rounds):.2f}-{max(rounds):.2f}x" in section
    # the same shapes, the same order, in the measurement of 2026-12-07's late evening
    before = json.loads((per.RESULTS / "speed_2026-12-07_joint" / "results_speed_2026-12-07_joint.json").read_text())
    now = json.loads((folder / name).read_text())["rows"]
    assert [r["model"] for r in before["rows"]] == [r["model"] for r in now]
    moved = {k: statistics.median(b["measured"][k] / a["measured"][k] - 1 for a, b in zip(before["rows"], now))
             for k in bench.SPEED_KEYS}
    predicted = {k: max(abs(b["predicted"][k] / a["predicted"][k] - 1) for a, b in zip(before["rows"], now))
                 for k in bench.SPEED_KEYS}
    b1, b32, c1, c32 = bench.SPEED_KEYS
    joint, one = summaries
    assert joint[b32]["within"] == 11
    assert f"is within 15% for all 11 shapes** (median {100 * joint[b32]['median']:+.0f}%)" in section
    earlier = [json.loads((per.RESULTS / "speed_2026-12-07_joint" / sub / "results_speed_2026-12-07_joint.json")
                          .read_text())["summary"] for sub in ("", "one_kind")]

    def within(fitted, measured, key):  # one set of rows' predictions against other speed-ups, as the table counts
        said = per.summary([{"predicted": f["predicted"], "measured": m} for f, m in zip(fitted, measured)])[key]
        return said["within"], said["median"]

    each_round = [statistics.median(b["rounds"][i][b32] / a["measured"][b32] - 1 for a, b in zip(before["rows"], now))
                  for i in range(3)]
    crossed = [within(before["rows"], [r["measured"] for r in now], b32),
               within(now, [r["measured"] for r in before["rows"]], b32)]
    outside = sum(not min(r[b32] for r in b["rounds"]) <= a["measured"][b32] <= max(r[b32] for r in b["rounds"])
                  for a, b in zip(before["rows"], now))
    assert (f"came out {100 * moved[b32]:.0f}% higher at the median than in the measurement above (each round alone: "
            f"{', '.join(f'{100 * m:+.0f}%' for m in each_round[:2])} and {100 * each_round[2]:+.0f}%), while the "
            f"joint fit's predictions moved by at most {100 * predicted[b32]:.0f}%") in section and moved[b32] > 0
    assert (f"the earlier fit against this measurement has {crossed[0][0]} of 11 within 15% "
            f"({100 * crossed[0][1]:+.0f}%), this fit against the earlier measurement {crossed[1][0]} of 11 "
            f"({100 * crossed[1][1]:+.0f}%). For {outside} of 11 shapes the earlier speed-up lies outside") in section
    assert (f"now misses: {joint[c1]['within']} of 11 within 15%, over-predicted by {100 * joint[c1]['median']:.0f}% "
            f"at the median**, where the measurement above had {earlier[0][c1]['within']} of 11") in section
    assert f"The joint fit predicts within {100 * predicted[c1]:.0f}% of what it predicted then" in section
    assert f"speed-ups came out {-100 * moved[c1]:.0f}% lower at the median" in section and moved[c1] < 0
    floor, teacher_cell = measurement["noise_floor"][c1], next(
        t for cell, t in measurement["speeds"].items() if cell.startswith("reference_teacher"))["speed"][c1]
    floor_rounds = [r[c1] for r in measurement["noise_floor_rounds"]]
    assert (f"Its noise floor was {floor:.2f}x ({min(floor_rounds):.2f}-{max(floor_rounds):.2f} over the rounds; the "
            f"teacher's own cell {teacher_cell:.2f}x)") in section and floor < 1 and teacher_cell < 1
    assert f"At batch 32, {joint[c32]['within']} of 11 ({100 * joint[c32]['median']:+.0f}%)" in section
    assert f"moved by {', '.join(f'{100 * moved[k]:+.0f}%' for k in (b1, b32, c1))} and {100 * moved[c32]:+.0f}%" \
        in section
    # only generate() at batch 1 has every shape within 15% in both measurements, with both fits; but crossed, and
    # one round at a time, it does not
    both = [k for k in bench.SPEED_KEYS if all(s[k]["within"] == s[k]["shapes"] for s in [*earlier, *summaries])]
    assert both == [b1] and "Only `generate()` at batch 1, the workload the default run prices" in section
    rounds_within = min(within(now, [r["rounds"][i] for r in now], b1)[0] for i in range(3))
    assert (f"its joint fit moved by up to {100 * predicted[b1]:.0f}% between the two (this fit against the earlier "
            f"measurement: {within(now, [r['measured'] for r in before['rows']], b1)[0]} of 11), and one round of "
            f"this measurement alone had {rounds_within} of 11") in section
    ended = [json.loads((bench.RESULTS / f).read_text())["when"] for f in ("speed_2026-12-07_joint.json",
                                                                           "speed_2026-12-08.json")]
    assert f"the two measurements ended at {ended[0][11:16]} and {ended[1][11:16]} UTC" in section
    # the status list says the same
    status = page.split("## 0.")[0]
    low, high = sorted(abs(v) for v in moved.values())[0], sorted(abs(v) for v in moved.values())[-1]
    assert (f"`generate()` at batch 32 is within 15% for {joint[b32]['within']} of 11 "
            f"({100 * joint[b32]['median']:+.0f}% at the median) and CTranslate2 int8 at batch 1 for "
            f"{joint[c1]['within']} of 11 ({100 * joint[c1]['median']:+.0f}%)") in status
    assert (f"speed-ups moved by {100 * low:.0f}-{100 * high:.0f}% at the median (up at `generate()` b32, down in the "
            f"other three), while the joint fit's predictions moved by at most {100 * predicted[c1]:.0f}% (CTranslate2 "
            f"int8 b1) to {100 * predicted[b1]:.0f}% (`generate()` b1)") in status
    assert moved[b32] > 0 and all(moved[k] < 0 for k in (b1, c1, c32)) and max(predicted.values()) == predicted[b1]
    assert min(predicted.values()) == predicted[c1]


def _joint_and_one_kind_fits_as_the_page_says(section: str, folder, name: str, dated: str) -> list[dict]:
    """Checks a 0h table of the fits with the joint probes (``folder``) and their one-kind refits (its one_kind/)
    against their results files (``name``), the joint fits' errors over their 17 probes as the section quotes them,
    and that each one-kind fit is the joint fit's 15 one-kind probes fitted again; returns both summaries."""
    from gatedprune.costs import table as latency_table
    from gatedprune.costs.latency import JOINT, fit, fit_error

    bench = load_benchmark("recovery")
    per = load_benchmark("fit_per_runtime")
    summaries = []
    for label, results in ((f"with the joint probes (17){dated}", folder),
                           (f"one kind per probe (15){dated}", folder / "one_kind")):
        said = json.loads((results / name).read_text())["summary"]
        summaries.append(said)
        cells = [f"{said[k]['within']} of {said[k]['shapes']}, {100 * said[k]['median']:+.0f}% "
                 f"({100 * said[k]['min']:+.0f}% to {100 * said[k]['max']:+.0f}%)" for k in bench.SPEED_KEYS]
        assert f"| {label} | {' | '.join(cells)} |" in section, cells
    errors = [fit_error(json.loads(per.fit_path(folder, k).read_text())["probes"]) for k in bench.SPEED_KEYS]
    assert (f"met their 17 probes within {100 * errors[0]:.1f}%, {100 * errors[1]:.1f}%, {100 * errors[2]:.1f}% and "
            f"{100 * errors[3]:.1f}%") in section
    for key in bench.SPEED_KEYS:  # the one-kind fit: the same timings, the joint probes left out
        _, _, probes = latency_table.read(per.fit_path(folder, key))
        single = [p for p in probes if not p["probe"].startswith(JOINT)]
        _, cost, _ = latency_table.read(per.fit_path(folder / "one_kind", key))
        base, coefficients = fit([p["structures"] for p in single], [p["seconds"] for p in single])
        assert len(single) == 15 and cost.base == pytest.approx(base)
        assert cost.coefficients == pytest.approx(coefficients)
    return summaries
