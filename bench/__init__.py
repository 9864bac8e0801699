"""parity's benchmarks: each module is a command that prints a table and writes it, with the
command line, the machine and the date, to docs/data/bench/ (`report.py`); `tables.py` renders
those files into the docs. Run them from the repository root as modules:

    python -m bench.step_time
    python -m bench.tables --check
"""
