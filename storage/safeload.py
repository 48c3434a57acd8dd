"""Reading what a checkpoint directory holds without running code from it.

A checkpoint's done-records and DCP's ``.metadata`` are pickles (DCP's own
format, so plain DCP reads Springback's checkpoints), and its non-tensor
items are ``torch.save`` bytes. Whoever can write into a checkpoint
directory could otherwise make every rank that restores from it run code.
So nothing read from storage is unpickled freely:

* `loads` unpickles a done-record or ``.metadata`` with an allow-list: the
  classes those files hold (DCP's metadata, planner and storage records,
  Springback's `DoneRecord` and `FileEntry`, torch sizes, dtypes, layouts and
  CPU tensors, plain containers); any other global is refused, naming it.
  Tensors inside (the RNG states of a done-record) are themselves read with
  ``torch.load(weights_only=True)``.
* `SafeLoadPlanner` is DCP's default load planner with the non-tensor items
  read by ``torch.load(weights_only=True)``: tensors and plain data only.

Failure semantics: a refused file raises ``pickle.UnpicklingError`` naming
the global it refers to (callers wrap it in a `StorageError` naming the
file); nothing of it is constructed and no state is changed.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from springback.storage import compat

_ALLOWED: dict[str, frozenset[str]] = {
    "builtins": frozenset({"set", "frozenset", "complex", "slice"}),
    "collections": frozenset({"OrderedDict"}),
    "torch": frozenset({"Size"}),
    "torch._utils": frozenset({"_rebuild_tensor_v2"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.distributed.checkpoint.metadata": frozenset({
        "BytesStorageMetadata", "ChunkStorageMetadata", "Metadata", "MetadataIndex",
        "StorageMeta", "TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.planner": frozenset({"TensorWriteData", "WriteItem", "WriteItemType"}),
    "torch.distributed.checkpoint.storage": frozenset({"WriteResult"}),
    "springback.storage.commit": frozenset({"DoneRecord"}),
    "springback.storage.manifest": frozenset({"FileEntry"}),
}


def _tensor_storage_from_bytes(b: bytes) -> Any:
    """What ``torch.storage._load_from_bytes`` does for a pickled tensor's
    storage, without its ``weights_only=False``."""
    return torch.load(io.BytesIO(b), weights_only=True, map_location="cpu")


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                           torch.memory_format)):
            return getattr(torch, name)
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _tensor_storage_from_bytes
        raise pickle.UnpicklingError(
            f"refers to {module}.{name}, which no checkpoint record holds; not loaded")


def loads(data: bytes) -> Any:
    """A done-record or DCP ``.metadata`` from its bytes (see the module
    docstring); raises ``pickle.UnpicklingError`` naming a refused global."""
    return _Unpickler(io.BytesIO(data)).load()


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner; non-tensor items are tensors and plain data only."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True, map_location="cpu")
        except pickle.UnpicklingError as e:
            named = re.search(r"GLOBAL (\S+)", str(e))
            raise pickle.UnpicklingError(
                f"the checkpoint's item {fqn} is not tensors and plain data"
                f"{f' (it names {named.group(1)})' if named else ''}; not loaded") from None
        if self.flatten_state_dict:
            compat.set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
