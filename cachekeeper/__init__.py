"""cachekeeper: never compile cold.

Prewarm torch.compile (Inductor) caches for the real training shapes, prove them
effective, fingerprint them against the toolchain, store them as content-addressed
snapshots, and restore the matching one on every training node before the job starts.

This package never imports torch at module level: only prewarm and verify do, inside the
child processes they start.
"""

from cachekeeper.errors import CachekeeperError

__version__ = "0.1.0"

__all__ = ["CachekeeperError", "__version__"]
