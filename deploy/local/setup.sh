#!/usr/bin/env bash
# Installs everything Springback needs on Debian 12 / Python 3.11, idempotently:
# the etcd server, python3-venv, Chromium with its WebDriver (for the dashboard's browser test), Slurm
# (for the tests against a real Slurm) and
# when missing (apt), a virtual environment in .venv with CPU torch and the package itself (editable)
# with its test extras, every Python distribution at the release constraints.txt pins (the tested
# set). Safe to run again: the venv is (re)installed when pyproject.toml or constraints.txt is newer
# than its stamp.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"

python="${PYTHON:-python3}"
packages=()
command -v etcd >/dev/null 2>&1 || packages+=(etcd-server)
# Debian's own python3 needs python3-venv for `python3 -m venv`.
"$python" -c 'import ensurepip, venv' >/dev/null 2>&1 || packages+=(python3-venv)
# Debian's own Chromium and chromedriver: tests/worker/test_dashboard.py drives them (selenium).
[ -x /usr/bin/chromium ] || packages+=(chromium)
[ -x /usr/bin/chromedriver ] || packages+=(chromium-driver)
# Debian's own Slurm 22.05 (~40 s with the apt update): tests/slurmcluster.py runs slurmctld and
# three slurmd on loopback for the `slurm` tests (auth/none: munge comes along, unused).
command -v slurmctld >/dev/null 2>&1 || packages+=(slurmctld slurmd slurm-client)
if [ ${#packages[@]} -gt 0 ]; then
  echo "setup: installing ${packages[*]} (apt)"
  if [ "$(id -u)" = 0 ]; then sudo=""; else sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${packages[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$python" -m venv .venv
fi
stamp=.venv/.springback-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  echo "setup: installing torch (CPU) and springback into .venv"
  # -c constraints.txt on every install: no dependency, direct or transitive, floats.
  .venv/bin/pip install -q -c constraints.txt --upgrade pip
  # Pinned here and in constraints.txt (equal: tests/deploy/test_constraints.py): the
  # package itself accepts a range (users bring their torch).
  torch="torch==2.13.0"
  .venv/bin/pip install -q -c constraints.txt "$torch"
  # The Hugging Face extra comes with the test extras (tests/integrations); the
  # torch pin again, so that no trainer's requirement replaces the CPU build.
  .venv/bin/pip install -q -c constraints.txt -e ".[test,hf,lightning]" "$torch"
  touch "$stamp"
fi
