"""``python -m cachekeeper ...`` is the same as the ``cachekeeper`` console script."""

from cachekeeper.cli import main

main()
