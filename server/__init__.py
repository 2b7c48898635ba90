"""The cache server (installed as ``cachekeeper.server``). Never imports torch."""
