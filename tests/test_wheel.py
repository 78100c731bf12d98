"""A pip-installed gatedprune trains, exports and summarises a sweep from an empty directory, with no clone in sight.

The wheel is built from this checkout and installed (``--no-deps``) into a fresh virtual environment. Its
dependencies (the pinned CPU torch, transformers, ...) come from the test's own environment through a ``.pth``
line rather than a second download of a gigabyte; gatedprune itself comes from the wheel alone, which the test
checks, and the commands run from an empty directory.
"""

import csv
import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from helpers import ROOT, offline_env

QUICK = ["experiment=smoke", "trainer.max_steps=12"]  # a dense phase of 10 steps, 2 gated steps


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The bin/ folder of a fresh virtual environment with the wheel of this checkout installed."""
    tmp = tmp_path_factory.mktemp("wheel")
    # built from a copy: setuptools writes build/ and *.egg-info beside the sources, and a stale build/ would
    # put modules deleted since into the wheel
    source = tmp / "source"
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", "outputs", "multirun", "docs", ".hypothesis",
        ".pytest_cache", "wandb", "lightning_logs", "tokenizer"))  # what the other test worker may be writing
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp / "dist"), str(source)], check=True, capture_output=True, timeout=300,
                   cwd=tmp)
    wheel = next((tmp / "dist").glob("gatedprune-*.whl"))
    subprocess.run([sys.executable, "-m", "venv", str(tmp / "venv")], check=True, timeout=300)  # bundled pip
    python = tmp / "venv" / "bin" / "python"
    site = Path(subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True, cwd=tmp, env=_env()).strip())
    # the wheel's own console scripts (gatedprune-train, -export, -sweep) land in bin/, pointing at this python;
    # installed before the dependencies are visible, so pip does not take the clone's editable install for it
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=300, cwd=tmp, env=_env())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return tmp / "venv" / "bin"


def _env() -> dict:
    """Offline, and with no path that leads back to the clone."""
    env = offline_env()
    env.pop("PYTHONPATH", None)
    return env


def _run(command: list, cwd: Path) -> str:
    proc = subprocess.run(command, capture_output=True, text=True, env=_env(), cwd=cwd, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_the_wheel_holds_package_configs_and_commands(installed, tmp_path):
    package = _run([installed / "python", "-c", "import gatedprune; print(gatedprune.__file__)"], tmp_path)
    assert package.startswith(str(installed.parent)) and str(ROOT) not in package  # the wheel's, not the clone's
    conf = Path(package).parent / "conf"
    shipped = sorted(p.relative_to(conf).as_posix() for p in conf.rglob("*.yaml"))
    assert shipped == sorted(p.relative_to(ROOT / "conf").as_posix() for p in (ROOT / "conf").rglob("*.yaml"))
    metadata = _run([installed / "python", "-c", "import importlib.metadata as m; print(m.version('gatedprune'))"],
                    tmp_path)
    assert _run([installed / "gatedprune-train", "--version"], tmp_path) == f"gatedprune {metadata}"
    assert "experiment: compare, converge, lambda_sweep, lambda_sweep_kinds, quality, smoke" in _run([installed / "gatedprune-train", "--help"], tmp_path)
    job = _run([installed / "gatedprune-train", "experiment=smoke", "--cfg", "job"], tmp_path)
    assert "d_model: 32" in job and "l0_lambda: 0.1" in job
    for tool in ("gatedprune-export", "gatedprune-finetune", "gatedprune-sweep", "gatedprune-evaluate",
                 "gatedprune-analyze", "gatedprune-latency"):
        assert _run([installed / tool, "--help"], tmp_path).startswith(f"usage: {tool}")


def test_train_export_and_sweep_from_an_empty_directory(installed, tmp_path):
    work = tmp_path / "project"
    work.mkdir()
    _run([installed / "gatedprune-train", *QUICK], work)
    (run,) = (work / "outputs").glob("*/*")  # Hydra's outputs/<date>/<time>, under the working directory
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == 12 and metrics["versions"]["gatedprune"] != "unknown"
    assert (run / "pruned" / "config.json").is_file()

    _run([installed / "gatedprune-export", str(run), "again"], work)
    assert json.loads((work / "again" / "export_report.json").read_text())["verification"]["passed"]

    # a user's own config extends the shipped ones without copying them
    (work / "my_conf" / "experiment").mkdir(parents=True)
    (work / "my_conf" / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - smoke\n\ntrainer:\n  max_steps: 12\n"
    )
    _run([installed / "gatedprune-train", "-m", "--config-dir", "my_conf", "experiment=mine",
          "pruning.l0_lambda=0.01,1"], work)
    (sweep,) = (work / "multirun").glob("*/*")
    _run([installed / "gatedprune-sweep", str(sweep)], work)
    with (sweep / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert sorted(float(row["lambda"]) for row in rows) == [0.01, 1.0] and {row["status"] for row in rows} == {"done"}
    assert (sweep / "pareto.png").stat().st_size > 0
    assert not list(installed.parent.rglob("outputs")) and not list(installed.parent.rglob("multirun"))
