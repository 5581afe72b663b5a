"""unikv's benchmarks: ``python -m benchmarks SUITE`` (see benchmarks/run.py)."""
