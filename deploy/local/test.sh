#!/usr/bin/env bash
# The README's test command: installs what is missing (deploy/local/setup.sh),
# then runs the default test suite against real etcd, gRPC, torch.distributed
# and an S3 server on loopback. Extra arguments go to pytest
# (e.g. `-m soak` for the long soaks, `-k planner` for a subset).
# The suite mostly waits (timeouts, liveness windows, process starts), so it
# runs on SPRINGBACK_TEST_WORKERS pytest-xdist workers, 2 by default, tests
# handed out one at a time (`--dist loadgroup`: tests marked `xdist_group`
# share a worker); 0 is one process (2,100-2,750 s for ~980 tests). Its agents
# fork their ranks from a warm interpreter (SPRINGBACK_FORK_SERVER=1 unless
# set; the product's default stays exec, and the tests that run both ways
# name the mode), as the tests' own gloo peers do (tests/sbtest.py
# start_python). Two workers so: 1,444-1,746 s (docs/operations.md).
# SPRINGBACK_TEST_LOAD=N is the loaded mode: N busy loops spin for the
# whole run (tests/conftest.py), weather every test must pass in. It ends
# with the 20 slowest
# tests (pyproject.toml) and the run's wall and CPU time.
# Fails when pytest collected no test (its exit code 5), never silently passes.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
"$root/deploy/local/setup.sh" || exit 1
cd "$root" || exit 1
# Sets `cpu` to the CPU seconds (user+sys) of this shell's finished children
# so far: pytest, its workers and every process they waited for. `times` runs
# here, not in a $(...) subshell, whose children would be its own.
times_out="$(mktemp)"
trap 'rm -f "$times_out"' EXIT
children_cpu() {
  times >"$times_out"
  cpu=$(awk 'NR == 2 { for (i = 1; i <= 2; i++) { split($i, t, /[ms]/); s += t[1] * 60 + t[2] }; print s }' "$times_out")
}
workers="${SPRINGBACK_TEST_WORKERS:-2}"
export SPRINGBACK_FORK_SERVER="${SPRINGBACK_FORK_SERVER:-1}"
children_cpu
cpu_before=$cpu
start=$SECONDS
.venv/bin/python -m pytest -n "$workers" --dist loadgroup "$@"
rc=$?
wall=$((SECONDS - start))
children_cpu
awk -v wall="$wall" -v cpu="$cpu" -v before="$cpu_before" 'BEGIN {
  cpu -= before
  printf "test.sh: %d s wall, %d s CPU (user+sys), %.2f cores busy on average\n", wall, cpu, (wall > 0 ? cpu / wall : 0)
}'
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
