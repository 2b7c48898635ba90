"""The snapshot format: what a snapshot is, how it is written, read, signed and taken.

    cachekeeper/snapshot/manifest.py    the manifest (``Manifest``, ``FileEntry``): the
                                        snapshot's id, its files, its fingerprint
    cachekeeper/snapshot/archive.py     the one-file archive (tar + zstd): written and read
                                        as a stream, every member checked
    cachekeeper/snapshot/signing.py     Ed25519 signatures of a manifest, and the trusted keys
    cachekeeper/snapshot/scan.py        which files of a cache dir a snapshot takes, read back
                                        exactly as scanned (descriptor-relative)
    cachekeeper/snapshot/provenance.py  what a prewarm proved about a dir, kept in it for the
                                        snapshot made from it (verified, devices, CPU state)
    cachekeeper/snapshot/make.py        a snapshot of a cache dir (``snapshot_dir``) into the
                                        local store, and its archive (``write_archive``)

The digest pattern and hashing they share is ``cachekeeper.integrity`` (bottom layer: the
wire types and the server's blob routes use it too). This package's ``__init__`` imports
nothing: postjob reads a dir through ``scan`` without paying for zstandard or signing.
"""
