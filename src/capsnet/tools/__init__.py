"""Release and measurement tooling on top of training: shipping a finished run as package weights
(capsnet.tools.ship: `capsnet push`, tools/ship_weights.py) and the profiler's analysis of a training step
(capsnet.tools.profiling: benchmarks/gpu_check.py).

May import: capsnet.training and everything below it; never experiments, viz or cli.
"""
