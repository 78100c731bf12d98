"""Timers for the latency fit: ``timer(models, workload) -> [seconds]``, one median per model.

Models are timed in turn (a, b, c, a, b, c, ...) after a warm-up each (``reports.speed.alternate``), so the load of
a shared machine falls on all alike, on the sources and calls the run's speed report times (``greedy_job``). On the
CPU the time is CPU time (``time.process_time``): wall time on a shared machine swings by a third between two
identical models, CPU time by a few per cent. On a GPU it is wall time after a synchronise.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn

from gatedprune.costs.workload import Workload
from gatedprune.reports.speed import alternate, greedy_job, random_sources, torch_threads


def _seconds(timings: list, workload: Workload) -> list[float]:
    """CPU time on the CPU; wall time (the job synchronises) on a GPU."""
    return [t.wall if workload.device == "cuda" else t.cpu for t in timings]


def _synchronised(job, device: str):
    if device != "cuda":
        return job

    def run(model):
        job(model)
        torch.cuda.synchronize()

    return run


def torch_timer(models: list[nn.Module], workload: Workload) -> list[float]:
    """generate() of the workload, exactly ``target_tokens`` new tokens per sentence, KV cache on."""
    models = [model.to(workload.device).eval() for model in models]
    job = greedy_job(models[0], workload.batch, workload.source_tokens, workload.target_tokens, workload.num_beams,
                     workload.device)

    with torch_threads(workload.threads):
        return _seconds(alternate(_synchronised(job, workload.device), models, workload.repeats), workload)


def ct2_timer(models: list[nn.Module], workload: Workload) -> list[float]:
    """CTranslate2's translate_batch of the workload (each model converted with ``gatedprune.deploy.ct2``)."""
    from gatedprune.deploy import ct2
    from gatedprune.deploy.extras import require

    require("ct2", ("ctranslate2",), "pruning.workload.runtime=ct2")
    import ctranslate2

    translators = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, model in enumerate(models):
            model = model.float().cpu().eval()
            tokens = [f"t{j}" for j in range(model.config.vocab_size)]  # ids are all the timing needs
            directory = Path(tmp) / str(i)
            ct2.save(model, tokens, directory, workload.quantization)
            translator = ctranslate2.Translator(
                str(directory), device=workload.device, compute_type=workload.quantization or "float32",
                inter_threads=1, intra_threads=workload.threads or torch.get_num_threads())
            translators.append(translator)
        sources = random_sources(models[0], workload.batch, workload.source_tokens)  # the ids generate() is timed on
        batch = [[tokens[t] for t in row] for row in sources.tolist()]

        def job(translator):
            translator.translate_batch(batch, beam_size=workload.num_beams, max_decoding_length=workload.target_tokens,
                                       min_decoding_length=workload.target_tokens)

        return _seconds(alternate(job, translators, workload.repeats), workload)


TIMERS = {"torch": torch_timer, "ct2": ct2_timer}
