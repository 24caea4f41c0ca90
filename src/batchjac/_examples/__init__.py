"""Deterministic example models (the benchmark workloads), identical across frameworks.

Weights are generated with numpy from a seed (``weights.py``); each framework module builds
the same network from them, so Jacobians can be compared across frameworks and against the
closed-form float64 reference in ``reference.py``.
"""
