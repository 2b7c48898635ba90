# The cachekeeper service image: FastAPI server, SQLite metadata, local blob directory.
# No torch: the server never imports it.
#   docker build -t cachekeeper-server .
#   docker run -p 8750:8750 -v ck-data:/data -e CACHEKEEPER_TOKENS='{"s3cret": "admin"}' cachekeeper-server
FROM python:3.12-slim AS server

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY deploy/constraints-server.txt ./deploy/
COPY cachekeeper ./cachekeeper
COPY server ./server
COPY client ./client
# The base package plus the server extra, every dependency at the version CI tested
# (deploy/constraints-server.txt; deploy/constraints-server.sh regenerates it).
RUN pip install -c deploy/constraints-server.txt ".[server]" && pip check && rm -rf /src

RUN useradd --system --uid 10001 --home-dir /data cachekeeper \
    && mkdir -p /data && chown cachekeeper /data
USER cachekeeper
VOLUME ["/data"]
EXPOSE 8750

HEALTHCHECK --interval=30s --timeout=3s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8750/healthz', timeout=2)"

ENTRYPOINT ["cachekeeper", "serve", "--host", "0.0.0.0", "--port", "8750", "--data", "/data"]
