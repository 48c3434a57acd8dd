# The Springback image: coordinator, node agent and CLI (`springback ...`).
#
#   docker build -t springback:latest .                                   # CPU torch
#   docker build -t springback:cuda --build-arg TORCH_VARIANT=cuda .      # CUDA torch
#
# The steps are those of deploy/local/setup.sh (the README's install), minus
# the test extras, the browser the tests use, and etcd (which runs in its own image): a virtual
# environment, the pinned torch, then this package, every distribution at the
# release constraints.txt pins. tests/deploy checks that the pin and the steps
# stay in step with setup.sh. The torch step takes no constraints (torch's CPU
# index may not hold the pinned releases of its dependencies); the package step
# then sets them to the pins from PyPI. A TORCH_VERSION other than the pin in
# constraints.txt is replaced by the pinned one at that step: change both.
# The CUDA variant's nvidia-* wheels are not in the tested set and float.
# The CUDA variant installs torch's CUDA wheels, which bundle the CUDA
# runtime; the node needs only the NVIDIA driver and container toolkit.
# Put your training script at /app/train.py (a derived image, or a volume).
# The base by digest: a re-pushed tag changes nothing here until this line does.
# The digest is the multi-platform index of python:3.11-slim-bookworm (Python
# 3.11.16 on the 24 Aug 2026 bookworm snapshot) as Docker's official-images
# record lists it (github.com/docker-library/repo-info, commit 33a22f41,
# repos/python/remote/3.11-slim-bookworm.md); it was not pulled where this was
# written (no registry reachable). To move it: `docker buildx imagetools
# inspect python:3.11-slim-bookworm` and put the index's digest here.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:0bee7276f83efd4a1ee05bbbf4281d95ed28e079220a9457f25a93e3f1e3c31b
FROM ${PYTHON_IMAGE}

ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

ENV PATH=/opt/springback/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /opt/springback
RUN python3 -m venv .venv
COPY constraints.txt ./
RUN pip install -q -c constraints.txt --upgrade pip
RUN case "$TORCH_VARIANT" in \
      cpu)  pip install -q --index-url "$TORCH_CPU_INDEX" "torch==$TORCH_VERSION" ;; \
      cuda) pip install -q "torch==$TORCH_VERSION" ;; \
      *)    echo "TORCH_VARIANT must be cpu or cuda, got '$TORCH_VARIANT'" >&2; exit 2 ;; \
    esac
COPY pyproject.toml README.md ./
COPY proto proto
COPY client client
COPY cli cli
COPY service service
COPY worker worker
COPY storage storage
COPY integrations integrations
RUN pip install -q -c constraints.txt . && springback --version

RUN useradd --create-home --uid 1000 springback && mkdir -p /app /var/lib/springback \
    && chown springback /var/lib/springback
USER springback
WORKDIR /app
EXPOSE 7070 9090
ENTRYPOINT ["springback"]
CMD ["--help"]
