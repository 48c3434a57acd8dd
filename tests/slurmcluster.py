"""The real Slurm of the Slurm tests: deploy/local/slurm_cluster.py, which
``deploy/local/demo.sh --slurm`` starts too (one definition of the cluster
for both), loaded by its path (deploy/local is no package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "deploy" / "local" / "slurm_cluster.py"
_spec = importlib.util.spec_from_file_location("slurm_cluster", _PATH)
assert _spec is not None and _spec.loader is not None
_module = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("slurm_cluster", _module)
_spec.loader.exec_module(_module)

CRED_EXPIRE_S = _module.CRED_EXPIRE_S
PREEMPT_GRACE_S = _module.PREEMPT_GRACE_S
FREEZER_ROOT = _module.FREEZER_ROOT
SlurmCluster = _module.SlurmCluster
missing = _module.missing

__all__ = ["CRED_EXPIRE_S", "FREEZER_ROOT", "PREEMPT_GRACE_S", "SlurmCluster", "missing"]
