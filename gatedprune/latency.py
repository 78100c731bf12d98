"""``python -m gatedprune.latency MODEL_DIR OUT.json``: the latency fit of a model on this machine (the command
``gatedprune-latency``; the cost model itself is ``gatedprune.costs``)."""

if __name__ == "__main__":
    import sys

    from gatedprune.cli import latency_command

    sys.exit(latency_command())
