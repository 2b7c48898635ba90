"""Where blob bytes live: one folder of backends behind one interface, one registry.

    cachekeeper/backends/base.py      the interface (BlobBackend, DirectAccess) and its
                                      results (BlobStat, PutResult)
    cachekeeper/backends/local.py     LocalBackend: a local directory, zstd at rest (the
                                      server's default, and a node's local store's blobs)
    cachekeeper/backends/s3.py        S3Backend: an S3-compatible object store, with direct
                                      access (presigned URLs); boto3, the server's extra
    cachekeeper/backends/registry.py  URL scheme -> opener: read by the server's settings
                                      and by its composition root

Nothing is imported here: a node's local store loads ``local`` alone, and ``s3`` (boto3)
loads only when an ``s3://`` store is opened.
"""
