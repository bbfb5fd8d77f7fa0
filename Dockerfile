# zero1's image, one for every role in docker-compose.yml: the API, the Ray head and the
# Ray GPU workers (a Ray cluster runs the same Python, Ray and code on every node).
#
#   docker build -t zero1 .                                                     # CUDA torch
#   docker build -t zero1 --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#
# The CUDA wheels of torch carry their own CUDA runtime, so the slim Python base serves GPU
# hosts too: they need only the NVIDIA driver and the NVIDIA Container Toolkit.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

# PyTorch's wheel index for the CUDA version of the hosts' driver (the cu128 build by default)
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_VERSION=2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A user of its own; /shared belongs to it, so the named volume mounted there (which Docker
# fills from the image on first use) is writable by the ranks and the API.
RUN groupadd --gid 1000 zero1 \
    && useradd --uid 1000 --gid zero1 --create-home --shell /usr/sbin/nologin zero1 \
    && install -d -o zero1 -g zero1 /app /shared

WORKDIR /app

# torch first, from the chosen index (its own dependencies with it); a layer that code
# changes do not rebuild
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# then zero1 with its mlflow extra (ZERO1_MLFLOW_TRACKING_URI) and their dependencies at the tested
# versions, and Ray's dashboard.
COPY docker/constraints.txt /tmp/constraints.txt
COPY --chown=zero1:zero1 pyproject.toml README.md ./
COPY --chown=zero1:zero1 service ./service
COPY --chown=zero1:zero1 workers ./workers
COPY --chown=zero1:zero1 migrations ./migrations
COPY --chown=zero1:zero1 examples ./examples
RUN pip install --constraint /tmp/constraints.txt ".[mlflow]" "ray[default]" \
    && python -c "import service.main, workers.runtime.actors, torch, ray, mlflow; print('torch', torch.__version__, 'ray', ray.__version__)"

USER zero1
# the API's port; Ray's ports are its own (6379 for the GCS, 8265 for its dashboard)
EXPOSE 8000
CMD ["zero1", "serve", "--host", "0.0.0.0", "--port", "8000"]
