"""The documentation site builds offline and strictly, its generated pages say what the code does, and the README
stays a page a newcomer reads in five minutes, every link of it leading somewhere."""

import re
import subprocess
import sys

import yaml

from helpers import ROOT, offline_env

sys.path.insert(0, str(ROOT / "scripts"))
import docs_reference  # noqa: E402
import mkdocs  # noqa: E402,F401  (the docs extra: make setup installs it; without it the suite fails here)


def test_the_site_builds_strictly_offline(tmp_path):
    # --strict: a broken link, a missing anchor or a docstring mkdocstrings cannot read fails the build
    env = offline_env() | {"NO_MKDOCS_2_WARNING": "1", "no_proxy": "*", "http_proxy": "http://127.0.0.1:9",
                           "https_proxy": "http://127.0.0.1:9"}  # nothing may be fetched at build time
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    for name in ("prune_heads", "load_pruned", "save_pruned", "export_gated", "L0Budget", "Michel", "EvenLayers",
                 "convert"):
        assert f'id="gatedprune.' in api and re.search(rf'id="gatedprune[\w.]*\.{name}"', api), name
    # the generated reference is in the site, with a group's options and a command's flags
    assert "pruning.target_latency" in (tmp_path / "site" / "reference" / "configuration" / "index.html").read_text()
    assert "--max-new-tokens" in (tmp_path / "site" / "reference" / "commands" / "index.html").read_text()


def test_the_generated_pages_are_current():
    assert docs_reference.stale() == [], "run python scripts/docs_reference.py"


def test_the_configuration_reference_lists_every_option_file_and_its_keys():
    page = docs_reference.configuration_page()
    for path in (ROOT / "gatedprune" / "conf").rglob("*.yaml"):
        if path.parent.name == "conf":
            assert f"### `{path.name}`" in page, path
        else:
            group = path.parent.relative_to(ROOT / "gatedprune" / "conf").as_posix()
            assert f"### `{group}={path.stem}`" in page, path
    # a value as the YAML sets it, its key where it lands in the composed config, the note beside it
    assert "| `finetune.steps` | `1000` |" in page
    assert "| `pruning.gates.init_log_alpha` | `3.0` | gates start open" in page
    assert "| `data.src_lang` | `en` |" in page
    # a key with no inline comment takes the comment lines right above it, never the file's opening description
    assert "| `pruning.target_ceiling` | `false` | true: a cost budget's lambda1 kept >= 0" in page
    rows = docs_reference._keys(["# the file's description", "first: 1", "# above the second", "second: 2", "",
                                 "# cut off by the blank line", "", "third: 3", "fourth: 4  # its own"])
    assert rows == [("first", "1", ""), ("second", "2", "above the second"), ("third", "3", ""),
                    ("fourth", "4", "its own")]
    chosen = yaml.safe_load((ROOT / "gatedprune" / "conf" / "train.yaml").read_text())["defaults"]
    model = next(item["model"] for item in chosen if isinstance(item, dict) and "model" in item)
    assert f"### `model={model}` (*default*)" in page


def test_the_commands_reference_is_each_parser_s_help():
    from gatedprune import cli

    page = docs_reference.commands_page()
    for name in set(cli.COMMANDS) - {"train"}:
        assert f"## `gatedprune-{name}`" in page and f"usage: gatedprune-{name}" in page, name
    proc = subprocess.run([sys.executable, "-m", "gatedprune", "latency", "--help"], capture_output=True, text=True,
                          env=offline_env() | {"COLUMNS": "100"}, timeout=120)
    assert proc.stdout.strip() in page


def test_a_stale_page_is_named_and_nothing_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(docs_reference, "OUT", tmp_path)
    (tmp_path / "commands.md").write_text("old\n")
    assert docs_reference.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "docs/reference/commands.md is stale" in err and "configuration.md is stale" in err
    assert (tmp_path / "commands.md").read_text() == "old\n" and not (tmp_path / "configuration.md").exists()


def test_every_manual_page_is_in_the_navigation():
    def pages(nav):
        for item in nav:
            for value in (item.values() if isinstance(item, dict) else [item]):
                yield from (pages(value) if isinstance(value, list) else [value])

    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.SafeLoader)
    listed = set(pages(config["nav"]))
    for folder in ("guide", "reference"):
        for page in (ROOT / "docs" / folder).glob("*.md"):
            assert f"{folder}/{page.name}" in listed, page
    assert all((ROOT / "docs" / page).is_file() for page in listed), listed - {
        p for p in listed if (ROOT / "docs" / p).is_file()}


def test_the_readme_is_short_and_its_links_lead_somewhere():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not link.startswith("http")]
    assert local and all((ROOT / link).exists() for link in local), [x for x in local if not (ROOT / x).exists()]
    # the pages the README sends a newcomer to
    for page in ("docs/guide/install.md", "docs/guide/speed_targets.md", "docs/guide/runtimes.md",
                 "docs/guide/sweeps.md", "docs/guide/evaluate.md", "docs/guide/models.md", "docs/recovery.md"):
        assert f"]({page}" in readme, page
