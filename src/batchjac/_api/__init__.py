"""The public verbs: each validates what it must and dispatches (in memory, store, Dask)."""
