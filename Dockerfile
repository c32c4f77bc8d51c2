# GPU image: the official PyTorch CUDA runtime, then diffserve on top.
# The base image's torch must match the pin in pyproject.toml (torch==2.13.0) so pip keeps it.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    DIFFSERVE_CACHE_DIR=/var/cache/diffserve
WORKDIR /opt/diffserve
COPY pyproject.toml README.md ./
COPY diffserve ./diffserve
RUN pip install --no-cache-dir . && diffserve models

EXPOSE 8000
# Bind all interfaces inside the container; publish the port to choose who can reach it.
ENTRYPOINT ["diffserve", "serve", "--host", "0.0.0.0"]
CMD ["--dynamic-batch-max-size", "8", "--dynamic-batch-delay-ms", "8"]
