#!/usr/bin/env bash
# The README's test command: installs what is missing (deploy/local/setup.sh),
# then runs the default test suite against real etcd, gRPC, torch.distributed
# and an S3 server on loopback. Extra arguments go to pytest
# (e.g. `-m soak` for the long soaks, `-k planner` for a subset).
# Fails when pytest collected no test (its exit code 5), never silently passes.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
"$root/deploy/local/setup.sh" || exit 1
cd "$root" || exit 1
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
