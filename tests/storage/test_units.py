"""Small pure functions: replicated-entry assignment, manifest parsing, directory names, URI joins."""

from __future__ import annotations

import io

import pytest
from hypothesis import given
from hypothesis import strategies as st

from springback.storage.manifest import Manifest, checkpoint_dir_name, parse_checkpoint_dir_name
from springback.storage.snapshot import assign_among_holders, assign_replicated
from springback.storage.store import join, resolve_storage_options


@given(st.dictionaries(st.text(min_size=1, max_size=8), st.integers(0, 10_000), max_size=40), st.integers(1, 8))
def test_each_replicated_entry_has_exactly_one_writer_and_loads_are_balanced(sizes, world):
    owner = assign_replicated(sizes, world)
    assert owner.keys() == sizes.keys() and all(0 <= r < world for r in owner.values())
    assert assign_replicated(dict(reversed(list(sizes.items()))), world) == owner  # order-independent
    loads = [sum(sizes[k] for k, r in owner.items() if r == rank) for rank in range(world)]
    assert max(loads) - min(loads) <= max(sizes.values(), default=0)


@given(st.dictionaries(st.text(min_size=1, max_size=8),
                       st.tuples(st.integers(0, 10_000),
                                 st.sets(st.integers(0, 7), min_size=1).map(lambda s: tuple(sorted(s)))),
                       max_size=40))
def test_an_entry_held_by_some_ranks_is_written_by_exactly_one_of_them(holders):
    owner = assign_among_holders(holders)
    assert owner.keys() == holders.keys()
    assert all(owner[k] in ranks for k, (_, ranks) in holders.items())
    assert assign_among_holders(dict(reversed(list(holders.items())))) == owner  # order-independent
    everyone = {k: (size, tuple(range(8))) for k, (size, _) in holders.items()}
    assert assign_among_holders(everyone) == assign_replicated(
        {k: size for k, (size, _) in holders.items()}, 8)  # held by all: as without holders


@given(st.integers(0, 10**9), st.integers(0, 10**6))
def test_checkpoint_dir_names_round_trip(step, gen):
    assert parse_checkpoint_dir_name(checkpoint_dir_name(step, gen)) == (step, gen)


def test_foreign_directory_names_are_not_checkpoints():
    assert parse_checkpoint_dir_name("step-12") == (12, 0)
    for name in ("tmp", "step-", "step-1-x", "_springback"):
        assert parse_checkpoint_dir_name(name) is None


def test_a_malformed_manifest_names_the_uri_and_the_problem():
    with pytest.raises(ValueError, match=r"s3://b/step-1/manifest.json.*'step'"):
        Manifest.from_json('{"format": "springback.checkpoint/v1"}', uri="s3://b/step-1/manifest.json")
    with pytest.raises(ValueError, match="format"):
        Manifest.from_json('{"format": "other"}', uri="x")


def test_join_keeps_the_scheme_and_resolves_the_s3_endpoint_from_the_environment(monkeypatch):
    assert join("s3://bucket/base/", "/step-1", "a.distcp") == "s3://bucket/base/step-1/a.distcp"
    monkeypatch.setenv("SPRINGBACK_S3_ENDPOINT_URL", "http://127.0.0.1:9000")
    assert resolve_storage_options("s3://b/x", None)["client_kwargs"]["endpoint_url"] == "http://127.0.0.1:9000"
    explicit = {"client_kwargs": {"endpoint_url": "http://other"}}
    assert resolve_storage_options("s3://b/x", explicit)["client_kwargs"]["endpoint_url"] == "http://other"
    assert resolve_storage_options("/local/path", None) == {}


def test_plain_settings_are_serialized_once_while_their_value_stays_the_same(monkeypatch):
    import torch

    from springback.storage import snapshot

    area = snapshot.StagingArea()
    saves = []
    real = torch.save
    monkeypatch.setattr(snapshot.torch, "save", lambda obj, f: (saves.append(obj), real(obj, f)))
    state = {"optim": {"param_groups.a.lr": 0.1, "param_groups.a.betas": (0.9, 0.99),
                       "other": {"nested": [1, 2]}}}
    first = area.snapshot(state, rank=0, world_size=1)
    again = area.snapshot(state, rank=0, world_size=1)
    assert len(saves) == 3 and first.data == again.data  # the second snapshot reused them
    state["optim"]["param_groups.a.lr"] = 0.05  # a scheduler changed it
    changed = area.snapshot(state, rank=0, world_size=1)
    assert saves[3:] == [0.05]
    lr = next(d for i, d in zip(changed.items, changed.data) if i.index.fqn == "optim.param_groups.a.lr")
    assert torch.load(io.BytesIO(lr)) == 0.05
