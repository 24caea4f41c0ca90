"""Tuning: everything that chooses between ways of computing the same numbers.

The rooms: :mod:`.state` (what one bound model has measured and decided: its ledgers, the
builds its races chose, where its decisions are kept on disk), and the policy, races, cache
and fast path of repeated calls beside it. This package imports nothing at import time: the
backends, below most of it, import :mod:`.state` alone.
"""
