#!/usr/bin/env bash
# The README's main command: installs what is missing (deploy/local/setup.sh),
# then runs a local Springback cluster that trains examples/tinylm through a
# worker crash and a join, with a live view and a closing summary.
# Safe to run again; every process it starts is stopped at the end.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
"$root/deploy/local/setup.sh"
exec "$root/.venv/bin/python" "$root/deploy/local/demo.py" "$@"
