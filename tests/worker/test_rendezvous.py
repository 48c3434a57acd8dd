"""Forming a generation's process group with real gloo ranks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from sbtest import run_python_all

PEER = str(Path(__file__).with_name("rendezvous_peer.py"))


@pytest.mark.timeout(60)
def test_a_rank_whose_previous_init_failed_still_meets_fresh_peers():
    # torch names groups after a per-process counter that a failed init leaves
    # raised; the two ranks below start the same generation with different
    # histories and must still find each other.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.add("springback/rdzv/g1//arrived", 1)  # a phantom peer that never inits
    survivor = subprocess.Popen([sys.executable, PEER, "0", str(store.port), "1"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # the fresh peer starts once the survivor's first init has failed
    seen = []
    for line in survivor.stdout:  # torch's own warnings come first
        seen.append(line)
        if "generation 1 failed as intended" in line:
            break
    else:
        pytest.fail("".join(seen))
    fresh = subprocess.Popen([sys.executable, PEER, "1", str(store.port), "0"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out1, _ = fresh.communicate(timeout=40)
    out0, _ = survivor.communicate(timeout=40)
    assert survivor.returncode == 0 and "sum 3.0" in out0, out0
    assert fresh.returncode == 0 and "sum 3.0" in out1, out1


LEAVER = str(Path(__file__).with_name("leaving_peer.py"))


@pytest.mark.timeout(90)
def test_a_rank_leaving_a_broken_generation_fails_its_peers_at_once_while_its_group_lives_on():
    # A survivor blocked on a receive from another survivor used to wait out the
    # collective timeout (30 s here): the other had left, but the user's DDP
    # wrapper kept the group, and so its sockets, open.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    (code0, code1), (out0, out1) = run_python_all([[LEAVER, str(r), str(store.port)]
                                                   for r in (0, 1)], timeout_s=80)
    assert code0 == 0 and "left holding True" in out0, out0
    assert code1 == 0, out1
    match = re.search(r"failed after ([0-9.]+)s naming (\S+)", out1)
    assert match is not None, out1
    assert float(match.group(1)) < 10, out1
    assert match.group(2) == "0", out1  # the error names the rank that left


MESH_CACHE = str(Path(__file__).with_name("mesh_cache_peer.py"))


@pytest.mark.timeout(60)
def test_each_generations_dtensors_are_bound_to_its_own_mesh_not_an_equal_older_one():
    # DTensor caches sharding decisions by value and meshes of one layout are
    # equal: without forgetting them, generation 2's op output was bound to
    # generation 1's mesh (whose groups were gone: in the sharded chaos soak a
    # rank died on "Could not resolve the process group registered under the
    # name 11" when the world came back to an earlier size)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out = subprocess.run([sys.executable, MESH_CACHE, str(store.port)], capture_output=True,
                         text=True, timeout=50)
    assert out.returncode == 0 and "own meshes [True, True, True]" in out.stdout, \
        out.stdout + out.stderr


@pytest.mark.timeout(30)
def test_a_collective_failure_that_torch_wraps_in_its_own_error_still_breaks_the_generation():
    """An FSDP reduction inside a pipeline stage's backward fails on a dead
    peer; torch's pipelining (`stage_backward`) re-raises gloo's error as
    ``RuntimeError("Failed to run stage backward ...") from e``, whose text
    names no collective. It is still a collective failure (else the rank
    exits and the generation's survivors lose their state: the 3-D test's
    first run), and the lost peer is still found from gloo's error. A
    user's error raised from a non-collective one is not."""
    import torch
    from torch.distributed.pipelining._backward import stage_backward

    from springback.worker.rank import rendezvous

    gloo = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
            "by peer [127.0.0.1]:60608. This is typically caused by a remote worker crashing.")
    x = torch.ones(3, requires_grad=True)
    y = (x * 2).sum()
    y.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError(gloo)))
    with pytest.raises(RuntimeError) as wrapped:
        stage_backward(y, None, [x])
    assert "gloo" not in str(wrapped.value)  # the wrapper's own text only
    assert rendezvous.is_collective_failure(wrapped.value)
    assert rendezvous.failure_line(wrapped.value) == gloo  # the log's "broke ...: <why>"
    rendezvous._endpoint_ranks["127.0.0.1:60608"] = 5
    try:
        assert rendezvous.lost_peer_rank(wrapped.value) == 5
    finally:
        del rendezvous._endpoint_ranks["127.0.0.1:60608"]
    try:
        raise RuntimeError("the user's loss went NaN") from ValueError("bad batch")
    except RuntimeError as user:
        assert not rendezvous.is_collective_failure(user)
