"""Host-path benchmarks (pytest-benchmark): what a decode step does on the host before a graph
replay can launch (batch building, LoRA planning, static-buffer refresh), and the comparison of
a run with the previous one. ``python -m bench.host`` (``nox -s hostbench``) runs them."""
