"""The head report (`python -m gatedprune.analyze`): of a gated run and of its export with uneven heads, its
attention measures against a direct computation, its ablation effects against physically pruned copies, and bad
input refused in one line with nothing written."""

import copy
import csv
import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import transformers

from helpers import error_line, offline_env, run_train
from gatedprune.structures.adapters import ATTENTION_KINDS, attention_sites
from gatedprune.reports.analysis import COLUMNS, ablation_effects, analysis_batches, attention_measures
from gatedprune.cli import analyze_command
from gatedprune.data import collate_pairs
from gatedprune.reports.evaluate import split_data, train_config
from gatedprune.surgery.cut import prune_heads

PAIRS = 24  # analysed per report: one batch of the smoke data
SHORT = ("trainer.max_steps=12", "dense_steps=4", "trainer.val_check_interval=6",  # a shorter smoke run
         "callbacks.checkpoint.every_n_train_steps=6", "optim.warmup_steps=4", "export.samples=8")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """A smoke run whose export keeps exactly 5 of 24 heads in 6 modules (uneven, so one at least has none), and
    both reports."""
    run = tmp_path_factory.mktemp("analyze") / "run"
    with pytest.MonkeyPatch.context() as patch:
        # one thread: tiny matrices on a shared 2-core box ran this 7x slower with two threads fighting (58 s vs 8 s)
        patch.setenv("OMP_NUM_THREADS", "1")
        proc = run_train(run, "pruning=l0_budget", "pruning.target_heads=5", *SHORT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for directory in (run, run / "pruned"):
        assert analyze_command([str(directory), "--max-pairs", str(PAIRS)]) == 0
    return run


def _rows(directory):
    with open(directory / "analysis" / "heads.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == list(COLUMNS)
        return list(reader)


def _number(text):
    return None if text == "" else float(text)


@pytest.mark.parametrize("which", ["run", "export"])
def test_a_report_has_every_head_and_every_column_in_range(reports, which):
    run = reports
    directory = run if which == "run" else run / "pruned"
    record = json.loads((run / "pruned" / "config.json").read_text())["gatedprune"]
    if which == "run":  # every head of the model
        expected = {(path, h) for path, n in record["num_heads"].items() for h in range(n)}
    else:  # the kept heads only, in their original numbering
        expected = {(path, h) for per_kind in record["kept_heads"].values() for path, heads in per_kind.items()
                    for h in heads}
        assert len(expected) == 5 and any(not heads for per_kind in record["kept_heads"].values()
                                          for heads in per_kind.values())  # a module left without heads
    rows = _rows(directory)
    assert {(r["path"], int(r["head"])) for r in rows} == expected and len(rows) == len(expected)
    # the analysed pairs, for the entropy bound: log of the number of keys a query can see
    batch, = analysis_batches(split_data(train_config(run), run / "tokenizer", "validation"), "validation", PAIRS)
    keys = {"encoder": int(batch["attention_mask"].sum(1).max()), "cross": int(batch["attention_mask"].sum(1).max()),
            "decoder": int((batch["labels"] != -100).sum(1).max())}
    for r in rows:
        values = {c: _number(r[c]) for c in COLUMNS if c not in ("path", "kind")}
        assert int(r["layer"]) in (0, 1) and r["kind"] in ATTENTION_KINDS
        if which == "run":
            assert 0 <= values["p_open"] <= 1
            assert values["p_open"] == pytest.approx(
                1 / (1 + math.exp(-(values["log_alpha"] - 0.33 * math.log(0.1 / 1.1)))), abs=1e-5)
        else:
            assert values["log_alpha"] is None and values["p_open"] is None
        assert values["importance"] >= 0 and math.isfinite(values["ablation"])
        assert 0 <= values["confidence"] <= 1
        assert 0 <= values["entropy"] <= math.log(keys[r["kind"]]) + 1e-5
        positional = [values[c] for c in ("to_prev", "to_same", "to_next")]
        if r["kind"] == "cross":
            assert positional == [None] * 3
        else:
            assert all(0 <= v <= 1 for v in positional) and sum(positional) <= 1 + 1e-6
        if r["kind"] == "encoder":
            assert 0 <= values["to_rarest"] <= 1 and 0 < values["rarest_chance"] <= 1
        else:
            assert values["to_rarest"] is None and values["rarest_chance"] is None
        if r["kind"] == "decoder":
            assert values["to_next"] == 0  # causal: nothing ahead to attend to
    for path in {r["path"] for r in rows}:  # Michel et al.'s scores, divided by their module's L2 norm
        assert sum(float(r["importance"]) ** 2 for r in rows if r["path"] == path) == pytest.approx(1, abs=1e-4)
    md = (directory / "analysis" / "heads.md").read_text()
    assert f"{PAIRS} pairs of the validation split" in md and all(f"| {r['path']} |" in md for r in rows)
    pictures = {p.name for p in (directory / "analysis").glob("heatmap_*.png")}
    kinds = {r["kind"] for r in rows}  # a measure is drawn where some head has it
    measures = {"importance", "ablation", "confidence", "entropy"}
    measures |= ({"p_open"} if which == "run" else set()) | ({"to_rarest"} if "encoder" in kinds else set())
    measures |= {"to_prev", "to_same", "to_next"} if kinds - {"cross"} else set()
    assert pictures == {f"heatmap_{m}.png" for m in measures}
    for name in pictures:
        assert (directory / "analysis" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_export_inside_a_run_finds_the_runs_data(reports):
    run = reports
    assert train_config(run / "pruned").data.max_val_pairs == 40  # experiment=smoke, as the run recorded it
    cfg = train_config(run / "pruned", ["data.max_val_pairs=7"])  # the run's command line, then the overrides
    assert cfg.data.max_val_pairs == 7 and cfg.data.vocab_size == 400
    assert train_config(run.parent).data.max_val_pairs is None  # outside a run: the trainer's defaults


EOS, PAD, SPECIAL = 2, 1, (0, 1, 2, 3)


@pytest.fixture(scope="module")
def tiny():
    """A tiny random mBART with peaked attention (large init), pruned unevenly (one module left without heads), in
    eager attention; a padded batch of sentences ending in EOS; and made-up training counts of every token."""
    torch.manual_seed(0)
    config = transformers.MBartConfig(
        vocab_size=40, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=16, decoder_ffn_dim=16, max_position_embeddings=32, init_std=0.5,
        pad_token_id=PAD, eos_token_id=EOS, bos_token_id=0, decoder_start_token_id=EOS, attn_implementation="eager",
    )
    model = transformers.MBartForConditionalGeneration(config).eval()
    prune_heads(model, {"model.encoder.layers.0.self_attn": [], "model.encoder.layers.1.self_attn": [1, 3],
                        "model.decoder.layers.1.encoder_attn": [2]})
    generator = torch.Generator().manual_seed(1)
    sentences = []
    for length in (5, 9, 7):
        src = torch.randint(4, 40, (length,), generator=generator).tolist() + [EOS]
        tgt = torch.randint(4, 40, (length - 1,), generator=generator).tolist() + [EOS]
        sentences.append((src, tgt, "", ""))
    batch = collate_pairs(sentences, PAD, with_texts=False)
    counts = torch.randint(0, 6, (40,), generator=generator)
    return model, batch, sentences, counts


def _direct(model, sentences, counts):
    """The measures computed sentence by sentence (no padding) from output_attentions, with Python loops."""
    sums = {}
    for src, tgt, _, _ in sentences:
        labels = torch.tensor([tgt])
        decoder_ids = model.prepare_decoder_input_ids_from_labels(labels=labels)[0].tolist()
        with torch.no_grad():
            out = model(input_ids=torch.tensor([src]), decoder_input_ids=torch.tensor([decoder_ids]),
                        output_attentions=True)
        candidates = [k for k, t in enumerate(src) if t not in SPECIAL]
        fewest = min(int(counts[src[k]]) for k in candidates)
        rarest = {k for k in candidates if int(counts[src[k]]) == fewest}
        for site in attention_sites(model):
            weights = {"encoder": out.encoder_attentions, "decoder": out.decoder_attentions,
                       "cross": out.cross_attentions}[site.kind][site.layer][0]
            tokens = src if site.kind == "encoder" else decoder_ids
            for h in range(site.num_heads):
                acc = sums.setdefault((site.path, h), {"n": 0, "confidence": 0, "entropy": 0, "to_prev": 0,
                                                        "to_same": 0, "to_next": 0, "to_rarest": 0})
                for q, token in enumerate(tokens):
                    if token == EOS:
                        continue
                    row = weights[h, q].tolist()
                    best = max(range(len(row)), key=row.__getitem__)
                    acc["n"] += 1
                    acc["confidence"] += row[best]
                    acc["entropy"] -= sum(p * math.log(p) for p in row if p > 0)
                    for name, step in (("to_prev", -1), ("to_same", 0), ("to_next", 1)):
                        acc[name] += best - q == step
                    acc["to_rarest"] += best in rarest
    return {key: {m: v / acc["n"] for m, v in acc.items() if m != "n"} for key, acc in sums.items()}


def test_attention_measures_match_a_direct_computation(tiny):
    model, batch, sentences, counts = tiny
    sites = attention_sites(model)
    assert [s.num_heads for s in sites] == [0, 2, 4, 4, 4, 1]
    measures = attention_measures(model, [batch], sites, EOS, SPECIAL, counts, progress=False)
    direct = _direct(model, sentences, counts)
    assert measures["model.encoder.layers.0.self_attn"]["confidence"].shape == (0,)
    for site in sites:
        for h in range(site.num_heads):
            ours, theirs = measures[site.path], direct[(site.path, h)]
            for name in ("confidence", "entropy"):
                assert float(ours[name][h]) == pytest.approx(theirs[name], abs=1e-5), (site.path, h, name)
            for name in ("to_prev", "to_same", "to_next"):
                expected = None if site.kind == "cross" else theirs[name]
                assert (ours[name] if ours[name] is None else float(ours[name][h])) == pytest.approx(expected)
            if site.kind == "encoder":
                assert float(ours["to_rarest"][h]) == pytest.approx(theirs["to_rarest"])
    # the measures are not all trivially equal: peaked attention, some heads positional
    confidences = [float(v) for m in measures.values() for v in m["confidence"]]
    assert max(confidences) > 0.5 and min(confidences) < max(confidences) - 0.1


def test_ablation_is_the_loss_of_the_model_without_that_head(tiny):
    model, batch, _, _ = tiny

    def loss(m):  # token-mean teacher-forced cross-entropy, written out here
        decoder_ids = m.prepare_decoder_input_ids_from_labels(labels=batch["labels"])
        with torch.no_grad():
            logits = m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       decoder_input_ids=decoder_ids).logits
        return float(F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100))

    heads = {s.path: list(range(s.num_heads)) for s in attention_sites(model)}
    base, effects = ablation_effects(model, [batch], heads, progress=False)
    assert base == pytest.approx(loss(model), abs=1e-6)
    for path, head in [("model.encoder.layers.1.self_attn", 1), ("model.decoder.layers.0.self_attn", 2),
                       ("model.decoder.layers.1.encoder_attn", 0)]:
        without = prune_heads(copy.deepcopy(model), {path: [h for h in heads[path] if h != head]})
        assert effects[path][head] == pytest.approx(loss(without) - base, abs=1e-5), (path, head)
    assert max(abs(e) for per in effects.values() for e in per.values()) > 1e-3  # the heads matter here


def test_bad_input_is_one_line_with_nothing_written(tmp_path, capsys):
    missing = tmp_path / "missing"
    proc = subprocess.run([sys.executable, "-m", "gatedprune.analyze", str(missing)], capture_output=True, text=True,
                          env=offline_env(), cwd=tmp_path, timeout=300)
    assert proc.returncode == 2 and f"{missing}: no such directory" in error_line(proc), proc.stderr[-2000:]
    empty = tmp_path / "empty"
    empty.mkdir()
    for args, says in (([str(empty)], "is neither a gated run directory"),
                       ([str(empty), "--max-pairs", "0"], "--max-pairs 0; allowed"),
                       ([str(empty), "--split", "dev"], "--split 'dev'; allowed: train, validation, test")):
        assert analyze_command([*args, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"] and not any(empty.iterdir())
