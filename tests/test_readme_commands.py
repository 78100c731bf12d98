"""Every command the README and the documentation site's pages (docs/**/*.md) show still works: train commands
compose with Hydra (with the page's overrides), the other gatedprune commands and the scripts accept the options the
page gives them, and make targets exist.

A command that stops working (a renamed option, a removed preset) fails here, not in a user's terminal.
"""

import re
import shlex
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from helpers import ROOT, offline_env

TRAIN = ("train.py", "gatedprune-train", "gatedprune.train")
# also as python -m gatedprune <command> (and python -m gatedprune.<command>)
TOOLS = ("gatedprune-export", "gatedprune-sweep", "gatedprune-evaluate", "gatedprune-analyze", "gatedprune-latency")
TESTED_ELSEWHERE = ("pip ",)  # building and installing the wheel: tests/test_wheel.py


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def readme_commands() -> list[str]:
    """The commands of every page's bash blocks: continuation lines joined, comments and env assignments dropped;
    each once (pages repeat the common ones)."""
    blocks = [b for page in PAGES for b in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S)]
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s+)#.*$", "", line).strip()
            words = [w for w in shlex.split(line) if w] if line else []
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # HF_HUB_OFFLINE=0 ...
                words.pop(0)
            if words and words[0] in ("export", "cd"):  # the shell's set-up, not a command of ours
                continue
            if words and shlex.join(words) not in commands:
                commands.append(shlex.join(words))
    return commands


COMMANDS = readme_commands()


def _program(words: list[str]) -> tuple[str, list[str]]:
    """(what runs, its arguments): "train", a tool's module, "make" or "pip"."""
    if words[0].endswith("python") and words[1:3] == ["-m", "gatedprune"]:  # python -m gatedprune export ...
        return f"gatedprune-{words[3]}", words[4:]
    if words[0].endswith("python") and words[1] == "-m":  # python -m gatedprune.analyze ...: the tool
        tool = words[2].replace("gatedprune.", "gatedprune-", 1)
        return tool if tool in TOOLS else words[2], words[3:]
    if words[0].endswith("python"):
        return words[1], words[2:]
    return words[0], words[1:]


def _first_values(override: str) -> str:
    """A multirun override (``a=1,2,3``) as its first value; commas inside [] or {} are list items."""
    key, _, value = override.partition("=")
    depth, cut = 0, len(value)
    for i, char in enumerate(value):
        depth += char in "[{" or -(char in "]}")
        if char == "," and depth == 0:
            cut = i
            break
    return f"{key}={value[:cut]}"


def test_the_readme_shows_commands_of_every_kind():
    programs = {_program(shlex.split(c))[0] for c in COMMANDS}
    assert {"make", "train.py", "gatedprune-train", *TOOLS} <= programs, programs


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command(command, tmp_path):
    # placeholders a user fills in (<date>, <run>, ...) as plausible values
    program, args = _program(shlex.split(re.sub(r"<([\w ]+)>", lambda m: m.group(1).replace(" ", "_"), command)))
    if command.startswith(TESTED_ELSEWHERE):
        return
    if program == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M)
        assert args[0] in targets, f"make {args[0]}: no such target in the Makefile"
    elif program in TRAIN:
        flags = {"-m", "--multirun"}
        overrides, skip = [], False
        for word in args:
            if skip:
                skip = False
            elif word in ("--cfg", "--config-dir", "-cd", "--config-name", "-cn"):
                skip = True  # a flag with a value: Hydra's own
            elif word == "--version" or word in flags:
                continue
            else:
                overrides.append(_first_values(word) if "-m" in args else word)
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=overrides, return_hydra_config=True)
        _check_applied(cfg, overrides)
    elif program.startswith(("benchmarks/", "scripts/")):  # a script: it exists, and takes the options shown
        returncode, stdout, stderr = _help((str(ROOT / program),), tmp_path)
        assert returncode == 0, stderr[-2000:]
        for option in (a for a in args if a.startswith("--")):
            assert option in stdout, f"{program} has no option {option}"
    else:
        assert program in TOOLS, f"unknown command {program!r} in the README"
        command = program.removeprefix("gatedprune-")
        returncode, stdout, stderr = _help(("-m", "gatedprune", command), tmp_path)
        assert returncode == 0, stderr[-2000:]
        for option in (a for a in args if a.startswith("--")):
            assert option in stdout, f"{program} has no option {option}"


_HELP: dict[tuple[str, ...], tuple[int, str, str]] = {}


def _help(program: tuple[str, ...], cwd) -> tuple[int, str, str]:
    """``python *program --help`` in an empty directory: (exit status, stdout, stderr), run once per program however
    many commands the pages give it (each start of the package costs seconds; every command's options are checked
    against that one text, which does not depend on the directory)."""
    if program not in _HELP:
        proc = subprocess.run([sys.executable, *program, "--help"], capture_output=True, text=True, env=offline_env(),
                              cwd=cwd, timeout=120)
        _HELP[program] = proc.returncode, proc.stdout, proc.stderr
    return _HELP[program]


def _check_applied(cfg, overrides: list[str]) -> None:
    """Each override of a README command took effect: a group option is the one chosen, a value is the one set."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    choices = cfg.hydra.runtime.choices
    for override in OverridesParser.create().parse_overrides(overrides):
        if override.is_delete():
            continue
        key, value = override.key_or_group, override.value()
        if key.lstrip("+") in choices:  # experiment=smoke, pruning=l0_budget, hydra/launcher=submitit_slurm
            assert choices[key.lstrip("+")] == value, override.input_line
        elif isinstance(value, str) and "${" in value:  # resume=<runs>/dense_s${seed}/...: Hydra resolved it
            actual = str(OmegaConf.select(cfg, key.lstrip("+")))
            pattern = re.sub(r"\\\$\\\{.*?\\\}", ".+", re.escape(value))  # each ${...} as what it resolved to
            assert re.fullmatch(pattern, actual), (override.input_line, actual)
        else:  # pruning.l0_lambda=0.05, trainer.max_steps=3000
            assert OmegaConf.to_container(OmegaConf.create({"v": OmegaConf.select(cfg, key.lstrip("+"))}),
                                          resolve=False)["v"] == value, override.input_line
