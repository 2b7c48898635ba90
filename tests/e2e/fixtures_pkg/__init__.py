"""A tiny importable "training package" for the prewarm tests' factories and entrypoints.

The tests put ``tests/e2e`` on the child's PYTHONPATH, so workloads can name
``fixtures_pkg.mods:relative_bias`` or ``fixtures_pkg.warmup:step`` as a real training
repo would name its own code.
"""
