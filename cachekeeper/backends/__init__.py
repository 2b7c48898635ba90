"""Where blob bytes live: one folder of backends (the local directory, the S3 API)."""
