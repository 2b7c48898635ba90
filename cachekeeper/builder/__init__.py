"""The builder: what a GPU builder runs to turn a workload into a verified cache dir.

Nothing is imported here, so that the server (which parses workloads with
``cachekeeper.builder.workload``) and a build's supervisor (``python -I``) load only the
modules they name.
"""
