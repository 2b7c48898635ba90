# The cachekeeper service image: FastAPI server, SQLite metadata, local blob directory.
# No torch: the server never imports it.
#   docker build -t cachekeeper-server .
#   docker run -p 8750:8750 -v ck-data:/data -e CACHEKEEPER_TOKENS='{"s3cret": "admin"}' cachekeeper-server
# https (tokens never in clear): mount a certificate and key, and add
#   -v /etc/ssl/ck:/tls:ro -e CACHEKEEPER_TLS_CERT=/tls/cert.pem -e CACHEKEEPER_TLS_KEY=/tls/key.pem
# BASE is any image with python3 >= 3.11 and its venv module (scripts/build_images builds
# one from Debian's packages with mmdebstrap where registry images cannot be pulled).
# Wheels put in deploy/wheels/ are installed from there, offline (scripts/build_images
# fills it); with none, pip installs from the index.
ARG BASE=python:3.12-slim
FROM ${BASE} AS server

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/cachekeeper/bin:$PATH

WORKDIR /src
COPY pyproject.toml README.md ./
COPY deploy/constraints-server.txt ./deploy/
COPY cachekeeper ./cachekeeper
COPY server ./server
COPY client ./client
# The base package plus the server extra, every dependency at the version CI tested
# (deploy/constraints-server.txt; deploy/constraints-server.sh regenerates it), in a venv
# (a distribution's own Python refuses system-wide installs, PEP 668).
# The wheels are bind-mounted, never copied: they add no layer to the image.
RUN --mount=type=bind,source=deploy/wheels,target=/wheels \
    python3 -m venv /opt/cachekeeper \
    && if ls /wheels/*.whl >/dev/null 2>&1; then offline="--no-index --find-links /wheels"; else offline=""; fi \
    && /opt/cachekeeper/bin/pip install $offline -c deploy/constraints-server.txt ".[server]" \
    && /opt/cachekeeper/bin/pip check \
    && rm -rf /src

RUN useradd --system --uid 10001 --home-dir /data cachekeeper \
    && mkdir -p /data && chown cachekeeper /data
USER cachekeeper
WORKDIR /data
VOLUME ["/data"]
EXPOSE 8750

# http, or https when TLS is on (the server's own certificate: not checked here).
HEALTHCHECK --interval=30s --timeout=3s \
    CMD python3 -c "import os, ssl, urllib.request as u; s='https' if os.environ.get('CACHEKEEPER_TLS_CERT') else 'http'; u.urlopen(s + '://127.0.0.1:8750/healthz', timeout=2, context=ssl._create_unverified_context())"

ENTRYPOINT ["cachekeeper", "serve", "--host", "0.0.0.0", "--port", "8750", "--data", "/data"]
