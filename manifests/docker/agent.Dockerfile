# The training image: the keepstep library, the node agent (`keepstep agent`, the pod
# entrypoint the operator sets) and the example scripts.
#
#   docker build -f manifests/docker/agent.Dockerfile -t keepstep/agent:0.1.0 .
#
# torch comes from PyPI (the CUDA build, which also runs on CPUs); for a smaller CPU-only
# image pass --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu
# The base image is pinned by digest (the tag is for readers): a rebuild gets the same bytes
# until someone moves the pin on purpose, e.g. to what
#   docker buildx imagetools inspect python:3.11-slim-bookworm
# prints as its Digest, in both Dockerfiles (tests/test_wheel.py checks they agree).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:a36c24f9cbdf4fd0f52d67f0823eeac19c2028c637cecc392d97f980d4fec56b
FROM ${PYTHON_IMAGE}

ARG TORCH_INDEX=""
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/keepstep
COPY pyproject.toml setup.py README.md ./
COPY requirements/lock.txt requirements/
COPY scripts/install-locked scripts/
COPY elastic/ elastic/
COPY agent/ agent/
COPY operator/ operator/
# Shipped beside the code in the wheel (`keepstep files`): examples, scenarios, the CRD.
COPY examples/ examples/
COPY e2e/scenarios/ e2e/scenarios/
COPY manifests/crd/ manifests/crd/
# Every dependency at the version the lock pins (the command CI's wheel test runs too).
RUN if [ -n "$TORCH_INDEX" ]; then \
        scripts/install-locked ".[train]" --extra-index-url "$TORCH_INDEX"; \
    else \
        scripts/install-locked ".[train]"; \
    fi \
    && pip check \
    && keepstep --version

# Training commands in samples name scripts relative to the working directory.
WORKDIR /workspace
COPY examples/ examples/

# A fixed non-root uid, so pod securityContexts can name it (runAsUser: 10001).
RUN useradd --uid 10001 --user-group --home-dir /workspace --no-create-home keepstep \
    && mkdir -p /var/lib/keepstep \
    && chown keepstep:keepstep /var/lib/keepstep
USER 10001:10001
# The pods' root file system is read-only (Pod Security "restricted"); /tmp is an emptyDir in
# every pod (keepstep.operator.template). Caches go there: numba's compiled kernels, which
# it cannot write beside the installed package, and whatever else keeps a cache.
ENV XDG_CACHE_HOME=/tmp/.cache \
    NUMBA_CACHE_DIR=/tmp/.cache/numba \
    TRITON_CACHE_DIR=/tmp/.cache/triton

ENTRYPOINT ["keepstep"]
CMD ["--help"]
