# The operator image: kopf, the Kubernetes and etcd clients, and keepstep's operator and
# agent-protocol modules. No torch: the operator never imports it (an import-linter
# contract), and the `operator` extra does not depend on it; the build fails if it appears.
#
#   docker build -f manifests/docker/operator.Dockerfile -t keepstep/operator:0.1.0 .
# The base image is pinned by digest (the tag is for readers): a rebuild gets the same bytes
# until someone moves the pin on purpose, e.g. to what
#   docker buildx imagetools inspect python:3.11-slim-bookworm
# prints as its Digest, in both Dockerfiles (tests/test_wheel.py checks they agree).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:a36c24f9cbdf4fd0f52d67f0823eeac19c2028c637cecc392d97f980d4fec56b
FROM ${PYTHON_IMAGE}

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
RUN scripts/install-locked ".[operator]" \
    && pip check \
    && python -c "import importlib.util as u, sys; bad = [m for m in ('torch', 'numpy') if u.find_spec(m)]; sys.exit('operator image must not contain ' + ', '.join(bad) if bad else 0)" \
    && python -c "import keepstep.operator, kopf, kubernetes"

RUN useradd --uid 10001 --user-group --no-create-home keepstep
USER 10001:10001

ENTRYPOINT ["python", "-m", "keepstep.operator"]
