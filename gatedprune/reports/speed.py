"""The measured speed-up of a pruned model over its dense model: greedy ``generate()``, timed side by side.

Timings on a shared machine are only fair as ratios of models timed in turn in one process (``alternate``); CPU time
(``time.process_time``, one thread) stands beside wall time because other processes barely move it. What a run
reports (``report.*`` in conf/train.yaml, ``SpeedOptions``): per batch size, the median milliseconds of one
``generate()`` call of each model and their ratio, plus both models' parameters and safetensors bytes.
The benchmark scripts (benchmarks/common.py) time with the same ``Timing`` and ``alternate``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import platform
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from omegaconf import DictConfig, OmegaConf

from gatedprune.utils import check_numbers


class Timing(NamedTuple):
    wall: float  # seconds on the clock: what a user waits
    cpu: float  # seconds of CPU this process used: barely moved by other processes on a shared machine (1 thread)


def now() -> Timing:
    """The real clock: wall and CPU seconds since some fixed point (only differences mean anything)."""
    return Timing(time.perf_counter(), time.process_time())


def alternate(job, models: list, repeats: int, warm_up=None, *, timer: Callable[[], Timing] | None = None
              ) -> list[Timing]:
    """Median wall and CPU seconds of ``job(model)`` per model, timed in turn (a, b, a, b, ...) after a warm-up.

    Alternating spreads the load of a shared machine over all models alike, so their ratio is fair. ``warm_up``
    (default: ``job``) is called once per model first; it may measure something else on the way (FLOPs).
    ``timer`` (default ``now``) reads the clock; a test gives a fake one.
    """
    timer = timer or now
    for model in models:
        (warm_up or job)(model)
    times = [[] for _ in models]
    for _ in range(repeats):
        for model, t in zip(models, times):
            start = timer()
            job(model)
            end = timer()
            t.append(Timing(end.wall - start.wall, end.cpu - start.cpu))
    return [Timing(statistics.median(x.wall for x in t), statistics.median(x.cpu for x in t)) for t in times]


@dataclass
class SpeedOptions:
    """``report.*``: whether and how a run measures the speed-up of the model it ships."""

    speed: bool = True  # off in experiment=smoke and the tests: it times real generation
    batches: tuple = (1, 32)  # sentences per generate() call, one measurement each
    source_tokens: int = 32  # random source ids per sentence
    new_tokens: int = 32  # generated per sentence, exactly (EOS held off until then)
    repeats: int = 3  # timed calls per model and batch size (median), after one warm-up call each
    # torch threads while timing; None: as torch is set. conf/train.yaml takes pruning.workload.threads where the
    # method predicts a latency, so the measured speed-up is of what was predicted
    threads: int | None = None

    def __post_init__(self) -> None:
        check_numbers("report", self)  # nan, inf, strings
        if not isinstance(self.speed, bool):
            raise ValueError(f"report.speed={self.speed!r}; allowed: true or false")
        self.batches = tuple(self.batches) if isinstance(self.batches, (list, tuple)) else (self.batches,)
        if not self.batches or not all(_whole(b) and b >= 1 for b in self.batches):
            raise ValueError(f"report.batches={list(self.batches)}; allowed: a list of whole numbers >= 1, "
                             "e.g. [1, 32]")
        if len(set(self.batches)) < len(self.batches):
            raise ValueError(f"report.batches={list(self.batches)} repeats a batch size; allowed: each at most once")
        for name in ("source_tokens", "new_tokens", "repeats"):
            value = getattr(self, name)
            if not (_whole(value) and value >= 1):
                raise ValueError(f"report.{name}={value}; allowed: a whole number >= 1")
        if self.threads is not None and not (_whole(self.threads) and self.threads >= 1):
            raise ValueError(f"report.threads={self.threads!r}; allowed: null or a whole number >= 1")

    def check_model(self, model) -> None:
        """The workload fits the model's positions (refused before training, not after it)."""
        positions = getattr(model.config, "max_position_embeddings", None)  # None: relative positions (T5)
        if not self.speed or positions is None:
            return
        for name, length in (("source_tokens", self.source_tokens), ("new_tokens", self.new_tokens + 1)):
            if length > positions:  # the decoder also holds its start token
                raise ValueError(f"report.{name}={getattr(self, name)} is longer than the model's "
                                 f"{positions} positions; allowed: at most {positions - (name == 'new_tokens')}")


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def speed_options(node: DictConfig | dict | None) -> SpeedOptions:
    """``report.*`` as ``SpeedOptions``; a config written before the node existed (None) gets the defaults."""
    if node is None:
        values = {}
    else:
        values = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    allowed = [field.name for field in dataclasses.fields(SpeedOptions)]
    for key in values:
        if key not in allowed:
            raise ValueError(f"report.{key}: no such option; allowed: {', '.join(allowed)}")
    return SpeedOptions(**values)


def random_sources(model, batch: int, source_tokens: int) -> torch.Tensor:
    """``batch`` random sources of ``source_tokens`` ids drawn for ``model``'s vocabulary, seeded: every model timed
    sees the same.  # (B, S)"""
    g = torch.Generator().manual_seed(0)
    high = max(model.config.vocab_size - 1, 4)  # ids 0-2 and the last are special in most families: avoided
    return torch.randint(3, high, (batch, source_tokens), generator=g)


def greedy_job(model, batch: int, source_tokens: int, new_tokens: int, num_beams: int = 1, device="cpu"):
    """``job(m)``: ``m.generate()`` (greedy, or beam search of ``num_beams``) of ``random_sources``, exactly
    ``new_tokens`` new tokens each, on ``device``."""
    ids = random_sources(model, batch, source_tokens).to(device)  # (B, S)
    mask = torch.ones_like(ids)

    @torch.no_grad()
    def job(m):
        # min = max: an untrained or pruned model that would stop early does the same work as the other
        return m.generate(input_ids=ids, attention_mask=mask, num_beams=num_beams, do_sample=False,
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens)  # (B, 1 + new_tokens)

    return job


def cpu_name() -> str:
    """The processor's model name (lscpu's), e.g. "AMD EPYC 7B13"; the platform's word for it where lscpu is not."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return re.search(r"Model name:\s*(.+)", lscpu).group(1).strip()
    except (OSError, subprocess.CalledProcessError, AttributeError):
        return platform.processor() or platform.machine()


def _ratio(dense: float, pruned: float) -> float | None:
    return dense / pruned if pruned > 0 else None  # a clock too coarse to see the call: no ratio, not infinity


@contextlib.contextmanager
def torch_threads(count: int | None):
    """torch's intra-op threads set to ``count`` (None: left as they are) for the block, then restored."""
    before = torch.get_num_threads()
    if count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def safetensors_bytes(model) -> int:
    """Bytes of the safetensors weights ``save_pretrained`` writes for ``model`` (what the export directory holds)."""
    with tempfile.TemporaryDirectory(prefix="gatedprune-size-") as tmp:
        model.save_pretrained(tmp)
        return sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors"))


def measure_speed(dense, pruned, options: SpeedOptions, *, timer: Callable[[], Timing] | None = None) -> dict:
    """Speed-up of ``pruned`` over ``dense`` (both on the CPU, float32, as the run ships them) for each of
    ``options.batches``: ``{"workload", "batches": {str(batch): {"dense_ms", "pruned_ms", "speed_up",
    "dense_cpu_ms", "pruned_cpu_ms", "cpu_speed_up"}}, "params", "file_bytes"}``; ``*_ms`` are medians of one
    ``generate()`` call of the whole batch, ``speed_up`` = dense / pruned (wall), ``cpu_speed_up`` (CPU time)."""
    batches = {}
    with torch_threads(options.threads):
        threads = torch.get_num_threads()
        times = {batch: alternate(greedy_job(dense, batch, options.source_tokens, options.new_tokens), [dense, pruned],
                                  options.repeats, timer=timer) for batch in options.batches}
    for batch, (dense_t, pruned_t) in times.items():
        batches[str(batch)] = {  # JSON keys are strings
            "dense_ms": 1e3 * dense_t.wall, "pruned_ms": 1e3 * pruned_t.wall,
            "speed_up": _ratio(dense_t.wall, pruned_t.wall),
            "dense_cpu_ms": 1e3 * dense_t.cpu, "pruned_cpu_ms": 1e3 * pruned_t.cpu,
            "cpu_speed_up": _ratio(dense_t.cpu, pruned_t.cpu),
        }
    return {
        "workload": {"decoding": "greedy generate()", "source_tokens": options.source_tokens,
                     "new_tokens": options.new_tokens, "repeats": options.repeats, "device": "cpu",
                     "dtype": "float32", "threads": threads},
        "batches": batches,
        "params": {name: sum(p.numel() for p in m.parameters()) for name, m in (("dense", dense), ("pruned", pruned))},
        "file_bytes": {"dense": safetensors_bytes(dense), "pruned": safetensors_bytes(pruned)},
    }
