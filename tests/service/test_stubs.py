"""The committed gRPC stubs match the .proto files (regenerate: proto/gen.sh)."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

PROTO = pathlib.Path(__file__).resolve().parents[2] / "proto"


@pytest.mark.timeout(60)
def test_committed_stubs_are_generated_from_the_current_protos(tmp_path):
    subprocess.run(["bash", str(PROTO / "gen.sh"), str(tmp_path)], check=True, timeout=60,
                   env={"PATH": f"{pathlib.Path(__import__('sys').executable).parent}:/usr/bin:/bin"})
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "proto/gen.sh generated nothing"
    stale = [str(p) for p in generated if (PROTO / p).read_text() != (tmp_path / p).read_text()]
    assert stale == [], f"stale stubs, run proto/gen.sh: {stale}"
