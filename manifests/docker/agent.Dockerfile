# The training image: the keepstep library, the node agent (`keepstep agent`, the pod
# entrypoint the operator sets) and the example scripts.
#
#   docker build -f manifests/docker/agent.Dockerfile -t keepstep/agent:0.1.0 .
#
# torch comes from PyPI (the CUDA build, which also runs on CPUs); for a smaller CPU-only
# image pass --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu
FROM python:3.11-slim

ARG TORCH_INDEX=""
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/keepstep
COPY pyproject.toml setup.py README.md ./
COPY elastic/ elastic/
COPY agent/ agent/
COPY operator/ operator/
# Shipped beside the code in the wheel (`keepstep files`): examples, scenarios, the CRD.
COPY examples/ examples/
COPY e2e/scenarios/ e2e/scenarios/
COPY manifests/crd/ manifests/crd/
RUN if [ -n "$TORCH_INDEX" ]; then \
        pip install --extra-index-url "$TORCH_INDEX" ".[train]"; \
    else \
        pip install ".[train]"; \
    fi \
    && keepstep --help > /dev/null

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
