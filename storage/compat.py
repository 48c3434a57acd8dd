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

import contextlib
import io
from collections.abc import Iterator
from typing import Any

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
    "RangeReads",
    "StorageInfo",
    "create_write_items",
    "flatten_state_dict",
    "set_element",
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


class _NoOpen:
    """A DCP reader's filesystem whose ``create_stream`` opens nothing (each
    item's bytes come from `RangeReads.read_range`); the rest is torch's."""

    def __init__(self, fs: Any) -> None:
        self._fs = fs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[None]:
        yield None


class RangeReads:
    """Mixin over DCP's ``FileSystemReader`` / ``FsspecReader``: the bytes of
    each item come from `read_range` (``relative_path``, ``offset``,
    ``length``), called once per item, in DCP's order, instead of from a file
    DCP opened. DCP's ``read_data`` opens each file (``fs.create_stream``),
    then cuts one view per item from it (the private ``_slice_file``); both
    are replaced here, the rest of ``read_data`` (transforms, ``torch.load``,
    the planner's calls) is DCP's own. ``item_ranges(plan)`` gives the
    ``(relative_path, offset, length)`` of a plan's items, in that order.
    The reader must serve ``read_metadata`` itself: DCP's own reads
    ``.metadata`` through ``create_stream``, which opens nothing here."""

    storage_data: dict[Any, Any]
    fs: Any  # the reader's: torch's filesystem, wrapped by use_range_reads

    def read_range(self, relative_path: str, offset: int, length: int) -> bytes:
        raise NotImplementedError

    def use_range_reads(self) -> None:
        """Call once the reader's ``fs`` is set (end of ``__init__``)."""
        self.fs = _NoOpen(self.fs)

    def item_ranges(self, plan: Any) -> list[tuple[str, int, int]]:
        by_file: dict[str, list[tuple[str, int, int]]] = {}
        for item in plan.items:  # read_data's grouping: by file, files in first-seen order
            info = self.storage_data[item.storage_index]
            by_file.setdefault(info.relative_path, []).append((info.relative_path, info.offset, info.length))
        return [r for ranges in by_file.values() for r in ranges]

    def _slice_file(self, file: Any, sinfo: Any) -> io.BytesIO:
        return io.BytesIO(self.read_range(sinfo.relative_path, sinfo.offset, sinfo.length))


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
