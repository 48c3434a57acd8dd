#!/usr/bin/env bash
# Regenerates the Python stubs of proto/springback/v1 in place (committed).
# Usage: proto/gen.sh [OUT_DIR]   (default: proto/, i.e. in place)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here}"
python -m grpc_tools.protoc -I"$here" --python_out="$out" --pyi_out="$out" \
  --grpc_python_out="$out" "$here"/springback/v1/*.proto
