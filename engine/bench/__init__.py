"""`ninfer-bench`: the user's A-B-A-B benchmark protocol as one command (see engine/bench/main.py), and every
other benchmark of the product as a subcommand (`ninfer-bench speculative`, `ninfer-bench gpu`).

Modules: main.py (the command line), variants.py (variants, workloads, runs as dataclasses), worker.py (one
measured run in its own process), runner.py (interleaving, idle gaps, busy-core load), report.py
(aggregation, table, JSON, ratios), bandwidth.py and stream_read.py (memory read bandwidth for the roofline);
speculative.py (plain vs speculative decoding, verify-pass cost), gpu.py (the cuda backend on one GPU).
"""
