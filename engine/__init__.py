"""ninfer engine: GGUF models on the CPU (numba) and GPU (numba.cuda), behind a small typed API.

The engine never imports the UI. Public entry points live in `engine.api`.
"""
