"""The HTTP client and pre-job hook (installed as ``cachekeeper.client``). Never imports torch."""
