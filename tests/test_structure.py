"""The package's shape: imports run one way (no cycle), every dotted command runs or refuses in one line, the paths
users and old runs name still resolve, defaults live once (the YAML), and a method plugs in by ``_target_`` alone."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.utils import get_object
from omegaconf import OmegaConf

from helpers import ROOT, compose_train, error_line, offline_env

PACKAGE = ROOT / "gatedprune"
MAX_LINES = 400

# the old module paths kept as thin aliases, and what each must still provide (README, configs runs recorded before,
# the dotted commands)
ALIASES = {
    "gatedprune.adapters": ["attention_sites", "pin_layout", "probe"],
    "gatedprune.analyze": ["analyze", "write_report", "heads_csv"],
    "gatedprune.baselines": ["AStar", "Michel", "Random"],
    "gatedprune.callbacks": ["DenseCheckpoint", "LastCheckpoint"],
    "gatedprune.csv_logger": ["ResumableCSVLogger"],
    "gatedprune.evaluate": ["evaluate_dir", "GenerationConfig", "score", "token_cross_entropy"],
    "gatedprune.finetune": ["FineTuneConfig"],
    "gatedprune.export": ["export_checkpoint", "export_gated"],
    "gatedprune.lightning_module": ["GatedSeq2Seq", "OptimConfig"],
    "gatedprune.model_loading": ["load_model", "load_pruned"],
    "gatedprune.sweep": ["summarise"],
}
# gatedprune.surgery was a module: its names resolve from the package (looked up where they live now)
SURGERY_NAMES = ["check_plan", "count_parameters", "load_pruned", "masked_heads", "prune_heads", "removed_parameters"]


# ---- imports run one way ---------------------------------------------------------------------------------------


def _skipped(node: ast.AST) -> bool:
    """An ``if __name__ == "__main__":`` block: an entry point. (An ``if TYPE_CHECKING:`` import is an edge: a cycle
    hidden from the interpreter is still two modules that need each other.)"""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators))


def import_graph(package: Path) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, imports inside functions included; ``from gatedprune import m``
    is an edge to ``m`` when ``m`` is a module, else to the package itself."""

    def name_of(path: Path) -> str:
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    files = {name_of(f): f for f in package.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges: set[str] = set()

        def visit(node: ast.AST) -> None:
            for child in ast.iter_child_nodes(node):
                if _skipped(child):
                    continue
                if isinstance(child, ast.Import):
                    edges.update(a.name for a in child.names)
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:  # relative: from . import x, from ..m import y
                        base = ".".join(here[: len(here) - child.level + 1] + ([base] if base else []))
                    edges.update(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in child.names)
                visit(child)

        visit(ast.parse(path.read_text(), filename=str(path)))
        graph[name] = {e for e in edges if e in files and e != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a] (depth first, modules in sorted order), or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        path.pop()
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (found := walk(start)):
            return found
    return None


def test_the_cycle_finder_sees_function_level_and_from_package_imports(tmp_path):
    package = tmp_path / "gatedprune"
    (package / "sub").mkdir(parents=True)
    for init in (package / "__init__.py", package / "sub" / "__init__.py"):
        init.write_text("")
    (package / "a.py").write_text("from gatedprune.sub import b\n")  # a module by `from package import m`
    (package / "sub" / "b.py").write_text("def f():\n    from gatedprune import c\n")  # inside a function
    (package / "c.py").write_text("from . import a\nif __name__ == '__main__':\n    import gatedprune.d\n")
    (package / "d.py").write_text("import gatedprune.c\n")
    (package / "e.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gatedprune import a\n")
    graph = import_graph(package)
    assert graph["gatedprune.c"] == {"gatedprune.a"}  # the __main__ block is an entry point, not an edge
    assert graph["gatedprune.e"] == {"gatedprune.a"}  # a typed import is one
    assert find_cycle(graph) == ["gatedprune.a", "gatedprune.sub.b", "gatedprune.c", "gatedprune.a"]
    (package / "sub" / "b.py").write_text("import gatedprune.d\n")  # a -> b -> d -> c, and c no longer imports a
    (package / "c.py").write_text("")
    assert find_cycle(import_graph(package)) is None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph(PACKAGE))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_only_entry_points_import_the_cli_and_no_module_imports_an_alias():
    graph = import_graph(PACKAGE)
    assert sorted(m for m, edges in graph.items() if "gatedprune.cli" in edges) == ["gatedprune.__main__"]
    importers = {m: sorted(edges & set(ALIASES)) for m, edges in graph.items() if edges & set(ALIASES)}
    assert importers == {}, f"modules importing an old path instead of its module: {importers}"


def test_the_modeling_file_copied_into_exports_imports_nothing_of_the_package():
    assert import_graph(PACKAGE)["gatedprune.surgery.pruned_modeling"] == set()
    source = (PACKAGE / "surgery" / "pruned_modeling.py").read_text()
    assert "gatedprune" not in "".join(line for line in source.splitlines() if line.lstrip().startswith(("import", "from")))


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


# ---- what users reach keeps working -----------------------------------------------------------------------------


def test_old_paths_and_the_readme_targets_resolve():
    for module, names in ALIASES.items():
        for name in names:
            assert callable(get_object(f"{module}.{name}")), f"{module}.{name}"
    # every full _target_ path the config groups page (docs/guide/configuration.md) names
    table = ROOT.joinpath("docs", "guide", "configuration.md").read_text()
    targets = set(re.findall(r"`(gatedprune(?:\.\w+)+\.[A-Z_a-z]\w*)`", table))
    assert {"gatedprune.methods.gated.L0", "gatedprune.training.module.GatedSeq2Seq"} <= targets
    for old in ("gatedprune.methods.L0", "gatedprune.methods.L0Budget"):  # the old path, through the package
        assert callable(get_object(old)), old
    for target in targets:
        assert callable(get_object(target)), target
    for name in SURGERY_NAMES:
        assert callable(get_object(f"gatedprune.surgery.{name}")), name
    import gatedprune

    for name in gatedprune.__all__:  # each a function or class of the package itself (or its tuple of kinds)
        value = getattr(gatedprune, name)
        assert isinstance(value, tuple) or value.__module__.startswith("gatedprune."), name
    assert gatedprune.head_importance.__module__ == "gatedprune.methods.importance"


def test_the_old_paths_are_one_table_and_the_top_level_holds_no_alias_module():
    from gatedprune.moved import MOVED

    assert set(ALIASES) == set(MOVED)
    commands = set(_command_modules())
    kept = {f"gatedprune.{path.stem}" for path in PACKAGE.glob("*.py")} & set(MOVED)
    assert kept == {"gatedprune.analyze", "gatedprune.evaluate", "gatedprune.export", "gatedprune.finetune",
                    "gatedprune.sweep"}  # each old path that kept a file is a command's entry point ...
    for name in kept:
        assert name in commands and "import *" not in (PACKAGE / f"{name.split('.')[1]}.py").read_text(), name
    import gatedprune.baselines as old  # ... and the others are made from the table

    assert not hasattr(old, "__file__") and old.Random.__module__ == "gatedprune.methods.random_draw"
    with pytest.raises(AttributeError, match="its names moved to gatedprune.methods.baselines"):
        old.NoSuchName


def _command_modules() -> list[str]:
    """Every module with an ``if __name__ == "__main__":`` block (the dotted forms a user can type)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        if any(_skipped(node) and not isinstance(node.test, ast.Name) for node in tree.body):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            found.append(".".join(parts))
    return found


# a bad argument each command refuses in its own words: proof that the command ran rather than nothing
DOTTED = {
    "export": (["/nonexistent/run", "/nonexistent/out"], "/nonexistent/run"),
    "finetune": (["/nonexistent/pruned", "--teacher", "/nonexistent/teacher"], "/nonexistent/pruned"),
    "sweep": (["/nonexistent/multirun"], "/nonexistent/multirun"),
    "evaluate": (["/nonexistent/model"], "/nonexistent/model"),
    "analyze": (["/nonexistent/run"], "/nonexistent/run"),
    "latency": (["/nonexistent/model", "out.json"], "/nonexistent/model"),
}


def test_every_dotted_command_runs_its_command_or_refuses_in_one_line(tmp_path):
    modules = _command_modules()
    expected = {"gatedprune.cli", "gatedprune.train", *(f"gatedprune.{c}" for c in DOTTED),
                "gatedprune.reports.sweep", "gatedprune.reports.evaluate",
                "gatedprune.reports.analysis"}
    assert set(modules) == expected, set(modules) ^ expected
    for module in sorted(set(modules) - {"gatedprune.__main__"}):
        command = next((c for c in DOTTED if module.endswith(c) or module.endswith(c.replace("analyze", "analysis"))),
                       None)
        args = DOTTED[command][0] if command else ["--version"]
        proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=tmp_path,
                              env=offline_env(), timeout=300)
        if command is None and module != "gatedprune.cli":  # gatedprune.train
            assert proc.returncode == 0 and proc.stdout.startswith("gatedprune "), (module, proc.stderr[-2000:])
            continue
        # refused in one line and nothing else on stderr (no warning of a module run twice, no progress bar)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (module, proc.stderr[-2000:])
        expected_words = "python -m gatedprune {train," if module == "gatedprune.cli" else DOTTED[command][1]
        assert expected_words in error_line(proc), (module, proc.stderr)


# ---- defaults once ---------------------------------------------------------------------------------------------


def _interpolated(node, key) -> bool:
    return isinstance(node._get_node(key)._value(), str) and "${" in node._get_node(key)._value()


# each method's own config (the default, pruning=first_layers, is a preset of speed, itself one of l0_budget, and
# finetune=default_run one of finetune=default: they override leaves on purpose)
@pytest.mark.parametrize("overrides", [["pruning=l0"], ["pruning=l0_budget"], ["pruning=michel"], ["pruning=astar"],
                                       ["pruning=random"]])
def test_every_dataclass_default_equals_its_yaml_value(tmp_path, overrides):
    cfg = compose_train(tmp_path, *overrides, "finetune=default")
    groups = ["pruning", "optim", "generation", "test_generation", "finetune", "export"]
    compared = 0
    for group in groups:
        node = cfg[group]
        cls = get_object(node._target_)
        for field in dataclasses.fields(cls):
            if field.name not in node or _interpolated(node, field.name):
                continue
            default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
            value = OmegaConf.to_container(node, resolve=True)[field.name]
            if dataclasses.is_dataclass(default):  # nested options (gates, distill): field by field
                default = {f.name: getattr(default, f.name) for f in dataclasses.fields(default)}
            normalise = json.loads(json.dumps(default, default=list))
            assert normalise == value, f"{group}.{field.name}: dataclass {default!r}, YAML {value!r}"
            compared += 1
    assert compared >= 20


# ---- a method plugs in by _target_ alone -----------------------------------------------------------------------


def test_a_new_method_runs_by_target_alone(tmp_path, monkeypatch):
    (tmp_path / "keep_all_method.py").write_text('''
from dataclasses import dataclass
from gatedprune.methods.base import Method
from gatedprune.methods.gated import GatedPruning

@dataclass
class KeepAll(Method):
    """Keeps every head: its run writes what it was handed and ships nothing."""
    name = "keep_all"
    note: str = ""

    def gating(self):
        return GatedPruning(kinds=self.kinds)

    def run(self, session):
        heads = session.module.gates.num_heads
        return {"method": self.name, "note": self.note, "heads": heads, "run_dir": str(session.run_dir)}
''')
    monkeypatch.syspath_prepend(str(tmp_path))
    from gatedprune.train import train

    cfg = compose_train(tmp_path / "run", "experiment=smoke")
    cfg.pruning = OmegaConf.create({"_target_": "keep_all_method.KeepAll", "kinds": ["encoder"], "note": "hello"})
    metrics = train(cfg)
    assert metrics == {"method": "keep_all", "note": "hello", "heads": 8, "run_dir": str(tmp_path / "run")}
    assert json.loads((tmp_path / "run" / "status.json").read_text())["status"] == "done"
