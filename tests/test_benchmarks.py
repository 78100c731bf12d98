"""The benchmark scripts still run (tiny sizes), and their head plans mean what they say."""

import importlib.util
from pathlib import Path

from gatedprune.adapters import attention_sites

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_even_plan_spreads_each_kind_over_its_layers():
    bench = _load("pruned_speed")
    model = bench.default_model(vocab_size=64)
    plan = bench.even_plan(model, {"encoder": 4, "decoder": 9, "cross": 0})
    kept = {kind: [] for kind in ("encoder", "decoder", "cross")}
    for site in attention_sites(model):  # in layer order
        kept[site.kind].append(len(plan[site.path]))
    assert kept == {"encoder": [2, 1, 1], "decoder": [3, 3, 3], "cross": [0, 0, 0]}


def test_pruned_speed_writes_its_table(tmp_path):
    bench = _load("pruned_speed")
    out = tmp_path / "speed.md"
    assert bench.main(["--repeats", "1", "--batch", "2", "--length", "4", "--new-tokens", "2", "--out", str(out)]) == 0
    text = out.read_text()
    assert "`benchmarks/pruned_speed.py --repeats 1 --batch 2 --length 4 --new-tokens 2 --out" in text  # its own command
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split(" | ")[1] for row in rows] == ["72", "48", "34", "16", "2"]
    assert rows[2].split(" | ")[2] == "6,462,912"  # the parameter count of the lambda 0.1 export of the sweep
