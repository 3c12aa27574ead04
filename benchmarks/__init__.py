"""devplugd performance suite: scripts that print numbers (they never assert timings).

Run one with ``python -m benchmarks.<name>`` from the repository root, or all with
``python -m benchmarks.run_all``. See benchmarks/README.md.
"""
