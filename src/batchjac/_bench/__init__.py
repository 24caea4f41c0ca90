"""Benchmark and demo support: the hand-written baselines batchjac is measured against."""
