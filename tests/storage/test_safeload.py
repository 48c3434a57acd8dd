"""Nothing read from a checkpoint directory runs code: forged done-records,
DCP metadata and non-tensor items are refused naming the file or item, and
what Springback writes still reads back."""

from __future__ import annotations

import pickle

import pytest
import torch

from springback.storage import Checkpointer, StorageError, restore
from springback.storage.commit import DCP_METADATA_NAME, load_record, record_name
from springback.storage.errors import CorruptCheckpoint
from springback.storage import dcpread
from springback.storage.store import ObjectStore, join

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


class _WritesMarker:
    """Unpickling this creates the file at `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _saved(tmp_path, state: dict) -> tuple[str, ObjectStore]:
    """The committed checkpoint's URI and store; the base is tmp_path/ck."""
    c = Checkpointer(f"file://{tmp_path}/ck", rank=0, world_size=1)
    info = c.save(1, state, generation=1).result(timeout=30)
    c.close()
    return info.uri, ObjectStore(info.uri)


def test_a_checkpoints_records_and_metadata_read_back_with_the_allow_list(tmp_path):
    uri, store = _saved(tmp_path, {"w": torch.arange(6.0), "bf": torch.ones(2, dtype=torch.bfloat16),
                                   "meta": {"lr": 0.1, "names": ["a"]}})
    record = load_record(store, uri, 0)
    assert record.rank == 0 and torch.is_tensor(record.rng["cpu"])
    reader = dcpread.reader_for(uri, store)
    metadata = dcpread.read_metadata(reader, uri, store)
    assert {"w", "bf"} <= set(metadata.state_dict_metadata)
    out = {"w": torch.zeros(6), "bf": torch.zeros(2, dtype=torch.bfloat16), "meta": {"lr": 0.0, "names": ["z"]}}
    restore(f"file://{tmp_path}/ck", out)
    assert torch.equal(out["w"], torch.arange(6.0)) and out["meta"] == {"lr": 0.1, "names": ["a"]}


def test_a_forged_done_record_is_refused_naming_it_and_never_run(tmp_path):
    uri, store = _saved(tmp_path, {"w": torch.ones(2)})
    marker = tmp_path / "ran"
    store.put_bytes(join(uri, record_name(0)), pickle.dumps(_WritesMarker(str(marker))))
    with pytest.raises(StorageError, match=r"unreadable done-record .*rank-00000\.pkl: refers to io\.open"):
        load_record(store, uri, 0)
    assert not marker.exists()


def test_forged_dcp_metadata_is_refused_naming_it_and_never_run(tmp_path):
    uri, store = _saved(tmp_path, {"w": torch.ones(2)})
    marker = tmp_path / "ran"
    store.put_bytes(join(uri, DCP_METADATA_NAME), pickle.dumps({"x": _WritesMarker(str(marker))}))
    reader = dcpread.reader_for(uri, store)
    with pytest.raises(CorruptCheckpoint, match=r"unreadable DCP metadata .*\.metadata: refers to io\.open"):
        dcpread.read_metadata(reader, uri, store)
    assert not marker.exists()


def test_a_non_tensor_item_that_names_a_callable_is_refused_naming_the_item(tmp_path):
    """DCP gathers the refusal into its CheckpointException (a BaseException)."""
    marker = tmp_path / "ran"
    _saved(tmp_path, {"w": torch.ones(2), "extra": _WritesMarker(str(marker))})
    with pytest.raises(BaseException, match=r"item extra is not tensors and plain data \(it names .*open\)"):
        restore(f"file://{tmp_path}/ck", {"w": torch.zeros(2), "extra": None})
    assert not marker.exists()
