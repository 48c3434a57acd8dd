#!/usr/bin/env bash
# Installs the goodput bench's optional baselines into their own venv, .bench-venv:
# CPU torch 2.13.0 (pinned first, so nothing pulls a CUDA build), torchft 0.2.0 on that
# torch (--no-deps, then its small pure-Python deps), python-etcd for torchrun's etcd-v2
# rendezvous, and springback itself (editable, for the bench's shared helpers).
# etcd's v2 API is served by the etcd binary with --enable-v2 (bench/goodput.py starts it).
# Idempotent; the default test suite needs none of this.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
venv=.bench-venv
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
stamp="$venv/.baselines-installed"
if [ ! -f "$stamp" ] || [ bench/setup.sh -nt "$stamp" ]; then
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q "torch==2.13.0"
  "$venv/bin/pip" install -q --no-deps "torchft==0.2.0"
  # torchft's own (pure-Python) requirements, without its torch requirement
  "$venv/bin/pip" install -q "opentelemetry-api>=1.39.0" "opentelemetry-sdk>=1.39.0" \
    "opentelemetry-exporter-otlp-proto-http>=1.39.0"
  "$venv/bin/pip" install -q "python-etcd==0.4.5" matplotlib
  "$venv/bin/pip" install -q -e .
  "$venv/bin/python" - <<'PY'
import importlib.metadata as md
import torch, torchft  # noqa: F401
assert torch.__version__.startswith("2.13.0") and not torch.version.cuda, torch.__version__
print("bench setup: torch", torch.__version__, "torchft", md.version("torchft"))
PY
  touch "$stamp"
fi
