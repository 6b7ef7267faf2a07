"""`ninfer-bench`: the user's A-B-A-B benchmark protocol as one command (see engine/bench/main.py).

Modules: main.py (the command line), variants.py (variants, workloads, runs as dataclasses), worker.py (one measured run in its own
process), runner.py (interleaving, idle gaps, busy-core load), report.py (aggregation, table, JSON, ratios),
bandwidth.py (memory read bandwidth for the roofline).
"""
