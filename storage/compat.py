"""The one place Springback touches private torch and fsspec APIs.

Each name below wraps something its library does not promise to keep (a
leading underscore, a private module, or an object whose pickled form is the
library's own). Everything else in Springback uses public APIs only, so a new
torch or fsspec release is checked by ``tests/storage/test_compat.py``, one
test per API here, before the supported range in pyproject.toml is widened.

Supported: torch 2.13 (the version the suite runs on; see pyproject.toml).
An API that is missing raises ImportError / AttributeError at import or first
use, naming it: there is no silent fallback. One private torch API lives
elsewhere: torch.distributed's group counter, reset in
`springback.worker.rank.rendezvous._reset_group_count` (so that starting a rank does
not import all of `springback.storage`); its test is here with the others.
"""

from __future__ import annotations

from typing import Any

import fsspec
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import _validate_global_plan
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.checkpoint.planner_helpers import _create_write_items
from torch.distributed.checkpoint.state_dict import _get_fqns

__all__ = [
    "FsspecReader",
    "StorageInfo",
    "create_write_items",
    "flatten_state_dict",
    "set_element",
    "strip_protocol",
    "validate_global_plan",
]

StorageInfo = _StorageInfo
"""DCP's per-item (file, offset, length) record in ``Metadata.storage_data``;
what `FileSystemReader` / `FsspecReader` read items by. Done-records pickle it,
and torch's `WriteItem`, so a checkpoint's records are read back by the torch
that can unpickle them (tests/storage/test_compat.py round-trips both)."""

# flatten_state_dict(state_dict) -> (flat {fqn: value}, mappings): DCP's own
# flattening, so our fqns are the ones its planners and readers use.
# set_element(state_dict, mappings[fqn], value): puts a flattened entry back
# at its nested place, as DCP's default load planner does.


def state_dict_names(model: Any, name: str) -> set[str]:
    """The names a parameter of `model` called `name` (``named_parameters``)
    has in torch's state dicts (wrappers' prefixes, such as DDP's
    ``module.``, left out)."""
    return _get_fqns(model, name)


def create_write_items(fqn: str, obj: Any) -> list[WriteItem]:
    """DCP's write items for one state-dict entry (one for a tensor or bytes,
    one per local shard for a DTensor)."""
    return _create_write_items(fqn, obj)


def validate_global_plan(plans: list[SavePlan], metadata: Metadata) -> list[str]:
    """DCP's check that the ranks' chunks tile each tensor without overlap;
    the problems found (empty: consistent)."""
    return list(_validate_global_plan(plans, metadata))


def strip_protocol(fs: fsspec.AbstractFileSystem, uri: str) -> str:
    """`uri` as a path of `fs` (``s3://b/k`` -> ``b/k``, ``file:///x`` -> ``/x``)."""
    return fs._strip_protocol(uri)

