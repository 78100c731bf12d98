"""What a pruned model costs: parameters, FLOPs and latency per structure, for a workload.

- ``counts``: the structures of a model, counted per kind and per layer (what every unit below is linear in).
- ``linear``: a cost linear in those counts (``LinearCost``: a base and one coefficient per kind), and the
  expected cost of the gates under it (``StructureCosts``: nesting-aware, the layer gate outside its content).
- ``flops``: the coefficients of the FLOPs of one generate() call, by formula.
- ``latency``: the coefficients of its time, fitted on timings of the dense model and cut copies of it.
- ``table``: latency fits saved beside the checkpoint, keyed by shapes, device, runtime and workload.
- ``workload``: what is costed (``pruning.workload``).
"""
