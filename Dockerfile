# halfserve for NVIDIA T4 (Turing, sm_75) and A10/A10G (Ampere, sm_86) GPUs; the same image serves on a CPU.
#
#   docker build -t halfserve .
#   docker run --gpus 1 -p 8000:8000 -p 8001:8001 --stop-timeout 45 halfserve
#
# Base image: python:3.11-slim-bookworm, not nvidia/cuda:*-cudnn-runtime. The CUDA build of torch ships its own
# CUDA runtime, cuBLAS, cuDNN and NCCL as nvidia-* wheels and loads those, so a CUDA base image would only add a
# second, unused set of the same libraries (several GB). The one piece that must come from the host is the driver
# (libcuda.so), which the NVIDIA Container Toolkit mounts in whenever the container is given a GPU (compose's device
# reservation, `docker run --gpus`, the Kubernetes device plugin). Host driver: R525 or newer (CUDA 12 minor-version
# compatibility).
#
# torch 2.13.0, the release the test suite runs on, in its CUDA 12.6 build. PyTorch's support matrix for 2.12-2.14
# lists sm_50, 60, 70, 75, 80, 86 and 90 for CUDA 12.6, so T4 (sm_75) and A10 (sm_86) run precompiled kernels, no
# PTX JIT at start-up. The CUDA 13.x builds also cover both cards but need an R580 or newer driver; 12.6 runs on R525+.

# Behind a mirror or a TLS-intercepting proxy (docs/deploy.md, "Building behind a mirror or proxy"), package sources
# come in at build time only. Index URLs are build args (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, TORCH_INDEX_URL); a
# pip.conf (an index with credentials), a CA bundle and an apt.conf are optional build secrets (ids pip_conf,
# ca_bundle, apt_conf): each is mounted under /run/secrets for the RUN step that uses it and never written to a layer,
# and the variables that point pip and apt at them live in that step's shell only. Given none, the build is the plain
# `docker build -t halfserve .`.

# The base by digest: python:3.11-slim-bookworm (Python 3.11.16, built 2026-08-25), the multi-platform index that
# Docker's docker-library/repo-info records, so a rebuild gets the same bytes wherever the tag has moved since. To move
# it: `docker buildx imagetools inspect python:3.11-slim-bookworm`, and paste the index digest here. No `# syntax=`
# line: BuildKit's built-in Dockerfile frontend, not one pulled by a floating tag at build time. The `RUN --mount`
# secret mounts below need that built-in frontend in Docker 23 or newer (BuildKit is its default builder), or podman
# build / buildah; the legacy builder (DOCKER_BUILDKIT=0) refuses them.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:0bee7276f83efd4a1ee05bbbf4281d95ed28e079220a9457f25a93e3f1e3c31b

FROM ${PYTHON_IMAGE} AS builder

# The lock's torch version (tests/unit/test_deploy_manifests.py checks they agree). TORCH_INDEX_URL set empty takes
# torch from the index pip is otherwise given (PIP_INDEX_URL, or the pip_conf secret for one with credentials).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
# No defaults: unset, pip uses PyPI. Builder stage only, so they are not in the runtime image's history.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

# torch first, in a layer of its own: it is most of the image and changes least. With it in place the project's
# torch>=2.3 requirement is met, so installing the project cannot pull a different torch build from PyPI.
# --no-deps: the torch index serves torch alone here; its dependencies (sympy, networkx, ..., and on CUDA the nvidia-*
# wheels and triton, which torch pins exactly) come with the project below, at the lock's versions.
RUN --mount=type=secret,id=pip_conf --mount=type=secret,id=ca_bundle \
    if [ -f /run/secrets/pip_conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip_conf; fi \
    && if [ -f /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi \
    && if [ -n "${TORCH_INDEX_URL}" ]; then export PIP_INDEX_URL="${TORCH_INDEX_URL}"; fi \
    && python -m venv /opt/venv \
    && pip install --no-deps "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY server ./server
# A regular (not editable) install: the venv is all the runtime stage takes; the source and build tree stay here.
# The train extra (rich, matplotlib, scikit-learn) makes every subcommand work in the image: serve, and also
# loadtest (compose's loadtest service) and train, for a few percent of the image's size.
# -c constraints.txt: the versions CI tested (the lock), torch's own dependencies included. It pins torch's version,
# which the CUDA build above meets (2.13.0+cu126 is 2.13.0). pip check: torch, installed without its dependencies,
# has them all now.
RUN --mount=type=secret,id=pip_conf --mount=type=secret,id=ca_bundle \
    if [ -f /run/secrets/pip_conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip_conf; fi \
    && if [ -f /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi \
    && pip install -c constraints.txt "./[train]" \
    && pip check \
    && halfserve --help >/dev/null


FROM ${PYTHON_IMAGE} AS runtime

# jemalloc replaces glibc malloc (LD_PRELOAD below). glibc serves large blocks with mmap and unmaps them on free, so
# every large activation of every forward page-faults fresh pages in; jemalloc keeps freed pages mapped for reuse.
# Measured on this project: fp32 CNN forwards on a CPU ran 1.8-2.4x faster with jemalloc or tcmalloc than with glibc
# malloc. On a GPU it still serves the host side (request decoding, numpy buffers, staging tensors).
# The symlink gives one LD_PRELOAD path on both x86_64 and aarch64. For this step only: the apt_conf secret, if
# given, is apt's configuration too (APT_CONFIG: a proxy, a mirror's credentials), and the ca_bundle secret the CAs
# it verifies an HTTPS mirror with.
RUN --mount=type=secret,id=apt_conf --mount=type=secret,id=ca_bundle \
    if [ -f /run/secrets/apt_conf ]; then export APT_CONFIG=/run/secrets/apt_conf; fi \
    && cainfo=/etc/ssl/certs/ca-certificates.crt \
    && if [ -f /run/secrets/ca_bundle ]; then cainfo=/run/secrets/ca_bundle; fi \
    && apt-get -o "Acquire::https::CAInfo=${cainfo}" update \
    && apt-get -o "Acquire::https::CAInfo=${cainfo}" install -y --no-install-recommends libjemalloc2=5.3.0-1 \
    && rm -rf /var/lib/apt/lists/* \
    && ln -s "/usr/lib/$(uname -m)-linux-gnu/libjemalloc.so.2" /usr/local/lib/libjemalloc.so.2 \
    && test -e /usr/local/lib/libjemalloc.so.2

# A numeric UID, so Kubernetes' runAsNonRoot can verify it without a passwd lookup.
RUN groupadd --system --gid 10001 halfserve \
    && useradd --system --uid 10001 --gid halfserve --create-home --home-dir /home/halfserve \
        --shell /usr/sbin/nologin halfserve

COPY --from=builder /opt/venv /opt/venv

# The default model store, baked in; mount another over /models (read-only is enough) to serve your own models.
COPY model_store /models
VOLUME ["/models"]

# Runtime configuration is HALFSERVE_* variables only (server/halfserve/settings.py); everything else here is for Python, the
# allocator and the NVIDIA Container Toolkit, and puts every cache (TorchInductor's, Triton's, CUDA's JIT, matplotlib's)
# under /tmp, so the image runs with a read-only root file system and one writable /tmp (compose's read_only + tmpfs,
# Kubernetes' readOnlyRootFilesystem + an emptyDir).
# background_thread: jemalloc purges unused pages from its own thread rather than on the request path.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    LD_PRELOAD=/usr/local/lib/libjemalloc.so.2 \
    MALLOC_CONF=background_thread:true \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    TMPDIR=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    TORCHINDUCTOR_CACHE_DIR=/tmp/.cache/torchinductor \
    TRITON_CACHE_DIR=/tmp/.cache/triton \
    CUDA_CACHE_PATH=/tmp/.cache/nv \
    MPLCONFIGDIR=/tmp/.cache/matplotlib \
    HALFSERVE_STORE=/models \
    HALFSERVE_HOST=0.0.0.0 \
    HALFSERVE_PORT=8000 \
    HALFSERVE_GRPC_PORT=8001 \
    HALFSERVE_DEVICE=auto \
    HALFSERVE_LOG_LEVEL=info

USER 10001:10001
WORKDIR /home/halfserve
# HTTP (/predict, KServe V2 REST) and gRPC (KServe V2, grpc.health.v1).
EXPOSE 8000 8001

# Ready, not just alive: /ready answers 503 until every model is loaded and warmed up, and again while draining.
# start-period covers CUDA initialisation, loading and warm-up.
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('HALFSERVE_PORT', '8000'), timeout=2)"]

# SIGTERM: report not ready, stop accepting, finish what is in flight and queued (up to the drain timeout, 30 s by
# default), exit 0. Give `docker stop` more than its 10 s default (--stop-timeout 45; compose sets stop_grace_period).
STOPSIGNAL SIGTERM

# halfserve runs as PID 1 and handles SIGTERM itself; `docker run halfserve loadtest ...` or `train ...` also work.
ENTRYPOINT ["halfserve"]
CMD ["serve"]
