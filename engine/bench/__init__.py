"""`ninfer-bench`: the user's A-B-A-B benchmark protocol as one command (see engine/bench/cli.py).

Modules: spec.py (variants, workloads, run specs as dataclasses), worker.py (one measured run in its own
process), runner.py (interleaving, idle gaps, busy-core load), report.py (aggregation, table, JSON, ratios),
bandwidth.py (memory read bandwidth for the roofline).
"""
