"""Test hook (on PYTHONPATH): every Python process started with RANK set and
ENVDUMP_DIR set writes its whole environment to ENVDUMP_DIR/env-<pid>.json at
interpreter start-up, before the script runs. This is how the restart-mode
tests see what torchrun and `springback run` give an unmodified script."""

import json
import os

if os.environ.get("ENVDUMP_DIR") and "RANK" in os.environ:
    _path = os.path.join(os.environ["ENVDUMP_DIR"], f"env-{os.getpid()}.json")
    with open(_path + ".tmp", "w") as _f:
        json.dump({"pid": os.getpid(), "env": dict(os.environ)}, _f)
    os.replace(_path + ".tmp", _path)
