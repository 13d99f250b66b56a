# compactor: one image for every process (watch, work, api, serve).
# Build: docker build -t compactor .    Run all-in-one: docker run -p 127.0.0.1:8080:8080 compactor
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    LITELLM_LOCAL_MODEL_COST_MAP=True \
    COMPACTION_DATA_DIR=/data

WORKDIR /app
COPY pyproject.toml README.md ./
COPY events ./events
COPY producer ./producer
COPY worker ./worker
COPY compactor ./compactor
RUN pip install . \
 && useradd --create-home --uid 1000 compactor \
 && mkdir -p /data \
 && chown compactor:compactor /data

USER compactor
VOLUME ["/data"]
EXPOSE 8080

HEALTHCHECK --interval=15s --timeout=10s --start-period=30s \
  CMD ["compactor", "health", "--check", "--api", "http://127.0.0.1:8080"]

# With REDIS_URL unset, `serve` runs an embedded Redis under /data/.redis.
CMD ["compactor", "serve", "--host", "0.0.0.0"]
