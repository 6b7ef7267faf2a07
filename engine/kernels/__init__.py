"""Kernels: `ref` (numpy, the specification), `cpu` (numba), `cuda` (numba.cuda). Same names and signatures.

Import a module through `engine.backend.get_backend(name)`; cuda is imported lazily only when selected.
"""
