"""The reshard's transfer planner on N-dimensional blocks (pure functions),
the placements it refuses (a real DTensor in a one-rank gloo group), and its
receive into views that are not contiguous (two real gloo ranks)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from sbtest import run_gloo_peers
from springback.worker.state.reshard import Box, Transfer, covered, plan_transfers, subtract, volume

pytestmark = pytest.mark.timeout(60)


def box(start: tuple[int, ...], end: tuple[int, ...], shape: tuple[int, ...] = (8, 6)) -> Box:
    return Box(shape, "float32", start, end)


def test_column_shards_fill_a_block_that_cuts_across_them():
    # tensor parallel's Shard(1) on two ranks -> a rank needing rows 2-6 of columns 1-5
    have = [{"w": box((0, 0), (8, 3))}, {"w": box((0, 3), (8, 6))}]
    need = [{}, {}, {"w": box((2, 1), (6, 5))}]
    transfers = plan_transfers(have, need)
    assert transfers == [Transfer("w", 0, 2, (2, 1), (6, 3)), Transfer("w", 1, 2, (2, 3), (6, 5))]
    assert covered(transfers, 2, {"w": (None, need[2]["w"])}) == []  # type: ignore[dict-item]


def test_the_receivers_own_block_goes_first_and_sending_is_spread_over_replicas():
    whole = box((0, 0), (8, 6))
    have = [{"w": whole}, {"w": whole}, {}, {}, {}, {}]
    halves = [box((0, 0), (4, 6)), box((4, 0), (8, 6))]
    need = [{"w": halves[0]}, {"w": halves[1]}] + [{"w": halves[i % 2]} for i in range(4)]
    transfers = plan_transfers(have, need)
    assert transfers is not None
    assert [t.src for t in transfers[:2]] == [0, 1]  # each holder keeps its own
    senders = [t.src for t in transfers[2:]]
    assert sorted(senders) == [0, 0, 1, 1], transfers  # not every block from rank 0


def test_a_part_no_rank_holds_means_no_plan_and_a_mismatched_tensor_too():
    have = [{"w": box((0, 0), (8, 3))}]
    assert plan_transfers(have, [{"w": box((0, 0), (8, 6))}]) is None
    other = Box((8, 6), "bfloat16", (0, 0), (8, 6))
    assert plan_transfers([{"w": other}], [{"w": box((0, 0), (8, 6))}]) is None


def test_covered_finds_a_gap_an_overlap_and_a_block_outside():
    target = {"w": (None, box((0, 0), (4, 6)))}
    whole = [Transfer("w", 1, 0, (0, 0), (4, 3)), Transfer("w", 1, 0, (0, 3), (4, 6))]
    assert covered(whole, 0, target) == []  # type: ignore[arg-type]
    gap = whole[:1]
    overlap = whole + [Transfer("w", 2, 0, (0, 2), (1, 4))]
    outside = [Transfer("w", 1, 0, (0, 0), (4, 3)), Transfer("w", 1, 0, (1, 3), (5, 6))]
    for transfers in (gap, overlap, outside):
        assert covered(transfers, 0, target) == ["w"], transfers  # type: ignore[arg-type]


def test_subtract_leaves_disjoint_blocks_that_with_the_inner_one_tile_the_outer():
    outer, inner = ((0, 0, 0), (5, 4, 3)), ((1, 1, 1), (3, 2, 2))
    parts = subtract(outer, inner)
    assert sum(map(volume, parts)) + volume(inner) == volume(outer)
    cells = [(i, j, k) for s, e in parts for i in range(s[0], e[0]) for j in range(s[1], e[1])
             for k in range(s[2], e[2])]
    assert len(cells) == len(set(cells))  # disjoint


REFUSAL = textwrap.dedent("""
    import os, tempfile, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard
    from springback.worker.state.reshard import NotReshardable, box_of
    store = dist.FileStore(tempfile.mktemp(), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    local, b = box_of(DTensor.from_local(torch.ones(4, 2), mesh, [Shard(1)]))
    print("shard", b.start, b.end)
    try:
        box_of(DTensor.from_local(torch.ones(4, 2), mesh, [Partial()]))
    except NotReshardable as e:
        print("refused:", e)
    dist.destroy_process_group()
""")


def test_a_partial_placement_is_refused_by_name():
    out = subprocess.run([sys.executable, "-c", REFUSAL], capture_output=True, text=True,
                         timeout=50)
    assert out.returncode == 0, out.stderr
    assert "shard (0, 0) (4, 2)" in out.stdout
    assert "refused: a Partial (unreduced) value: reduce it first" in out.stdout, out.stdout


VIEW_PEER = os.path.join(os.path.dirname(__file__), "reshard_view_peer.py")


@pytest.mark.timeout(45)
def test_blocks_received_into_strided_views_land_bit_for_bit(tmp_path):
    """reshard_view_peer.py: a tp-degree change (column shards into a whole
    row-major tensor), column shards into row shards, and row shards into a
    transposed target: every receive goes to a view that is not contiguous,
    so through `exchange`'s landing buffer (the path of every receive on GPU,
    whose held pieces are host copies), and must write the peer's bits."""
    results = run_gloo_peers(VIEW_PEER, 2, str(tmp_path / "store"), timeout_s=40)
    keys = {"tp2_to_tp1", "cols_to_rows", "into_transposed"}
    for rank, result in enumerate(results):
        assert result["strided"] == dict.fromkeys(keys, True), (rank, result)  # the path under test
        assert result["received"] > 0 and result["written"], (rank, result)
        assert result["differ"] == dict.fromkeys(keys, 0), (rank, result)


LOST_PEER = os.path.join(os.path.dirname(__file__), "reshard_lost_peer.py")


@pytest.mark.timeout(45)
@pytest.mark.parametrize("late_s", ["0", "1.0"], ids=["lost-in-the-wait", "lost-before-the-post"])
def test_a_sender_lost_mid_exchange_leaves_every_posted_receive_registered(tmp_path, monkeypatch,
                                                                          late_s):
    """reshard_lost_peer.py: the sender dies before it sends; the receiver's
    first wait fails with its second receive still posted. Both receive
    buffers must be registered with `handed_to_gloo` when the exchange
    raises: registered only after the waits, they were not, `leave_group`
    did not wait for gloo to let them go, and a rank aborted with glibc's
    heap corruption in an FSDP x TP x PP reshard whose holder was killed.
    Started 1 s late, the receiver's post itself fails (a loaded fresh-clone
    run: registered only after the posts, none was)."""
    monkeypatch.setenv("LOST_PEER_LATE_S", late_s)
    receiver, _ = run_gloo_peers(LOST_PEER, 2, str(tmp_path / "store"), timeout_s=40)
    assert receiver == {"raised": True, "handed": 2, "left": True}, receiver
