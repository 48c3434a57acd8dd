"""Departures: why a member went, said by the generation that plans
without it.

A caller that removes a member (`membership.Membership.leave`, the peer-loss
fence of `evidence`) notes why (`note`) before it revokes the member's lease;
whichever change then replans without the member names it so (`naming`,
called by `Coordinator.change`) and records its kind. A member that went
unnoted (its lease expired) is named "lost ... (liveness timeout)". A caller
says which members its own reason names (`Coordinator.change`'s ``named``):
reason text is never searched.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb

if TYPE_CHECKING:
    from springback.service.core.coordinator import Coordinator


def note(c: Coordinator, job_id: str, member_id: str, why: str,
         kind: js.ChangeKind) -> None:
    """Records why a member goes (\"lost m-1 (peers: ...)\", \"m-1 left: ...\")
    and as what `kind` of change, before its caller revokes its lease:
    whichever change then replans without it (that caller's own, or a
    progress flush, a start report or the reconcile loop that read the
    membership first) names it so and records its kind."""
    with c.changed:
        c.job_state(job_id).departures[member_id] = (why, kind)


def naming(c: Coordinator, job_id: str, previous: pb.Plan | None,
           members: list[pb.Member], reason: str, named: Collection[str]
           ) -> tuple[str, list[js.ChangeKind]]:
    """`reason`, preceded by the members of `previous` (active or spare)
    that are no longer registered and that the caller did not say
    `reason` names (`named`: its text is never searched), each
    with its noted departure or, when none was noted (its lease expired),
    \"lost ... (liveness timeout)\"; and the kinds of every such departure
    (named in `reason` or not: its text does not decide a kind). A
    generation's reason and kind thus say what changed the membership,
    whichever writer happened to land that change first."""
    if previous is None:
        return reason, []
    live = {m.id for m in members}
    planned = [m.member_id for m in previous.members] + list(previous.spares)
    gone = [m for m in planned if m not in live]
    with c.changed:
        departures = c.job_state(job_id).departures
        noted = {m: departures.get(m, (f"lost {m} (liveness timeout)",
                                       js.CHANGE_KIND_NODE_LOST))
                 for m in gone}
    notes = [why for m, (why, _) in noted.items() if m not in named]
    kinds = [kind for _, kind in noted.values()]
    return ("; ".join([*notes, reason]) if notes else reason), kinds
