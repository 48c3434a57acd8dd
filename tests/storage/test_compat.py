"""One test per private torch / fsspec API behind storage/compat.py: what
Springback relies on each to do. Run these first on a new torch or fsspec
before widening the supported range in pyproject.toml."""

from __future__ import annotations

import dataclasses
import pickle

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from springback.storage import Checkpointer, compat
from springback.worker.rank.rendezvous import _reset_group_count, forget_meshes


def test_flatten_state_dict_names_nested_entries_by_dotted_path():
    flat, mappings = compat.flatten_state_dict({"model": {"w": torch.ones(2)}, "step": 3})
    assert set(flat) == {"model.w", "step"} and set(mappings) == {"model.w", "step"}


def test_set_element_puts_a_flattened_entry_back_at_its_nested_place():
    nested = {"model": {"w": torch.ones(2)}, "extra": {"sampler": {"epoch": 1}}}
    _, mappings = compat.flatten_state_dict(nested)
    compat.set_element(nested, mappings["extra.sampler.epoch"], 7)
    assert nested["extra"]["sampler"] == {"epoch": 7}


def test_create_write_items_gives_one_tensor_item_or_one_bytes_item():
    (tensor_item,) = compat.create_write_items("w", torch.zeros(4, 2))
    assert tensor_item.type == WriteItemType.TENSOR and tensor_item.index.fqn == "w"
    assert list(tensor_item.tensor_data.size) == [4, 2]
    (bytes_item,) = compat.create_write_items("extra", {"epoch": 1})
    assert bytes_item.type == WriteItemType.BYTE_IO


def test_storage_info_and_write_items_survive_the_done_records_pickle():
    info = compat.StorageInfo("__0_0.distcp", 128, 64)
    assert pickle.loads(pickle.dumps(info)) == info
    assert (info.relative_path, info.offset, info.length) == ("__0_0.distcp", 128, 64)
    (item,) = compat.create_write_items("w", torch.zeros(3))
    again = pickle.loads(pickle.dumps(item))
    assert again.index == item.index and again.tensor_data.size == item.tensor_data.size


def _plan(fqn: str, rows: tuple[int, int], total: int) -> SavePlan:
    """One rank's plan holding rows [rows[0], rows[1]) of a (total, 2) tensor."""
    (item,) = compat.create_write_items(fqn, torch.zeros(total, 2))
    offsets, sizes = torch.Size([rows[0], 0]), torch.Size([rows[1] - rows[0], 2])
    data = dataclasses.replace(item.tensor_data, chunk=ChunkStorageMetadata(offsets, sizes))
    shard = dataclasses.replace(item, index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                                tensor_data=data)
    return SavePlan(items=[shard])


def test_validate_global_plan_names_chunks_that_overlap_and_passes_a_tiling():
    tiling = [_plan("w", (0, 2), 4), _plan("w", (2, 4), 4)]
    _, md = create_default_global_save_plan(tiling, rewrite_index_hints=False)
    assert compat.validate_global_plan(tiling, md) == []
    overlap = [_plan("w", (0, 3), 4), _plan("w", (1, 4), 4)]
    _, md = create_default_global_save_plan(overlap, rewrite_index_hints=False)
    assert compat.validate_global_plan(overlap, md)


def test_fsspec_reader_loads_what_the_checkpointer_wrote():
    base = "memory://compat-reader"
    ckpt = Checkpointer(base, rank=0, world_size=1)
    info = ckpt.save(1, {"w": torch.arange(6.0)}, generation=1).result(timeout=30)
    ckpt.close()
    loaded = {"w": torch.zeros(6)}
    dcp.load(loaded, storage_reader=compat.FsspecReader(info.uri))
    assert torch.equal(loaded["w"], torch.arange(6.0))


def test_range_reads_read_every_item_by_read_range_and_open_no_file():
    base = "memory://compat-range-reads"
    ckpt = Checkpointer(base, rank=0, world_size=1)
    sd = {"w": torch.arange(6.0), "b": torch.ones(3), "meta": {"k": 1}}
    info = ckpt.save(1, sd, generation=1).result(timeout=30)
    ckpt.close()
    fs = fsspec.filesystem("memory")
    metadata = compat.FsspecReader(info.uri).read_metadata()
    asked: list[tuple[str, int, int]] = []

    class Reader(compat.RangeReads, compat.FsspecReader):
        def __init__(self, uri: str) -> None:
            super().__init__(uri)
            self.use_range_reads()

        def read_metadata(self, *args: object, **kwargs: object):
            return metadata  # DCP's own read opens .metadata through create_stream

        def read_range(self, relative_path: str, offset: int, length: int) -> bytes:
            asked.append((relative_path, offset, length))
            return fs.cat_file(f"{info.uri}/{relative_path}", start=offset, end=offset + length)

        def read_data(self, plan, planner):
            assert self.item_ranges(plan) == [(self.storage_data[i.storage_index].relative_path,
                                               self.storage_data[i.storage_index].offset,
                                               self.storage_data[i.storage_index].length) for i in plan.items]
            return super().read_data(plan, planner)

    loaded = {"w": torch.zeros(6), "b": torch.zeros(3), "meta": {"k": 0}}
    reader = Reader(info.uri)

    def no_open(*args: object) -> None:
        raise AssertionError("a file was opened")

    reader.fs._fs.create_stream = no_open  # torch's own stream: never opened
    dcp.load(loaded, storage_reader=reader)
    assert torch.equal(loaded["w"], sd["w"]) and torch.equal(loaded["b"], sd["b"]) and loaded["meta"] == {"k": 1}
    assert len(asked) == 3 and {p for p, _, _ in asked} == {"__0_0.distcp"}


def test_reset_group_count_puts_the_counter_back_to_zero_without_a_group():
    assert not dist.is_initialized()
    dist.distributed_c10d._world.group_count = 3  # what a failed init_process_group leaves
    _reset_group_count()
    assert dist.get_pg_count() == 0


def test_forget_meshes_empties_dtensors_sharding_caches():
    # the private entry points it calls exist and leave the caches empty (the
    # behaviour is tests/worker/test_rendezvous.py's mesh-cache test)
    from torch.distributed.tensor import DTensor

    forget_meshes()
    propagator = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
    assert propagator.cache_info().currsize == 0
    assert torch._C._get_DTensor_sharding_propagator_cache_stats() is not None


def test_state_dict_names_leave_a_wrappers_prefix_out():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert compat.state_dict_names(model, "0.weight") == {"0.weight"}
    compiled = torch.compile(model)  # an OptimizedModule: parameters under _orig_mod.
    assert compat.state_dict_names(compiled, "_orig_mod.0.weight") == {"0.weight"}
