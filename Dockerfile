# The Shoal image the manifests in deploy/ reference (docs/deploying-on-kubernetes.md: build, push).
#   docker build -t shoal:0.1.0 .                                   # CPU
#   docker build --build-arg EXTRAS=gpu,torch -t shoal:0.1.0-gpu .   # CUDA IPC helpers and PyTorch
# Two stages: the wheel is built (protoc runs in grpcio-tools) in the first; the second installs it
# into a venv on a slim Python base without build tools, and runs as UID 1000 with no writable HOME.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY server server
COPY clients clients
COPY proto proto
RUN python -m pip wheel --no-cache-dir --disable-pip-version-check --no-deps --wheel-dir /wheels ./proto ./clients .

FROM ${PYTHON_IMAGE}
ARG EXTRAS=""
COPY --from=build /wheels /wheels
RUN python -m venv /opt/shoal \
    && wheel=$(ls /wheels/shoal-*.whl) \
    && /opt/shoal/bin/pip install --no-cache-dir --disable-pip-version-check \
        /wheels/shoal_protocol-*.whl /wheels/shoal_client-*.whl "${wheel}${EXTRAS:+[$EXTRAS]}" \
    && /opt/shoal/bin/pip uninstall -y pip setuptools \
    && rm -rf /wheels
# Nothing is written outside $TMPDIR and /dev/shm: no bytecode caches, no HOME.
ENV PATH=/opt/shoal/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/nonexistent \
    TMPDIR=/tmp
USER 1000:1000
EXPOSE 8000 8001 8002 8080 9000
# No ENTRYPOINT: a manifest's args are the whole command line (as with kserve-tritonserver's image).
CMD ["shoal", "serve", "--model-store=/mnt/models", "--grpc-port=9000", "--http-port=8080", "--allow-grpc=true", "--allow-http=true"]
