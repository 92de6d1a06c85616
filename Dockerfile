# syntax=docker/dockerfile:1
# The production image: the spillgate wheel (the gateway, its policies, the planner and the
# simulator; no benchmarks, no test support) in a venv on slim Python, run as a non-root user.
# Config is mounted at /etc/spillgate/gateway.yaml; secrets come from the environment.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md* ./
COPY gateway ./gateway
COPY policies ./policies
COPY loadtest ./loadtest
RUN python -m pip wheel --no-deps --wheel-dir /wheels . \
    && python -m venv /opt/spillgate \
    && /opt/spillgate/bin/pip install /wheels/*.whl

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="spillgate" \
      org.opencontainers.image.description="Overflow-aware inference gateway"
RUN groupadd --system --gid 10001 spillgate \
    && useradd --system --uid 10001 --gid spillgate --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin spillgate
COPY --from=build /opt/spillgate /opt/spillgate
ENV PATH=/opt/spillgate/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SPILLGATE_HEALTH_URL=http://127.0.0.1:8080/healthz
USER 10001:10001
EXPOSE 8080
# Liveness only (the process answers); readiness is /readyz, probed by the orchestrator.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['SPILLGATE_HEALTH_URL'], timeout=2)"]
ENTRYPOINT ["spillgate"]
CMD ["serve", "-c", "/etc/spillgate/gateway.yaml", "--host", "0.0.0.0"]
