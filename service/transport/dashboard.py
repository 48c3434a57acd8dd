"""A read-only web dashboard of the coordinator, on its metrics HTTP listener.

Pages (HTML rendered on the server; the job page adds one small script,
served from ``/live.js`` rather than inline so that the listener's
Content-Security-Policy can forbid inline scripts; no external assets):

* ``/`` — every job: state, generation, world size, progress, loss, newest
  checkpoint, timestamps.
* ``/jobs/{id}`` — one job: its summary, goodput, the generation timeline
  (`service/core/history.py`), its committed checkpoints, and plots of the world
  size and the step rate over time.
* ``/jobs/{id}/world.svg``, ``/jobs/{id}/steps.svg`` — those plots, drawn by
  matplotlib (SVG, Agg-free object API, so no display is needed).
* ``/jobs/{id}/series.json`` — the job's (time, step, loss) points as the
  leader accepted them (`Coordinator.series`: at most `SERIES_POINTS`, 2,000,
  the newest; empty on a non-leader) and its generations' start steps and
  reasons. The job page's script polls it every second and draws the live
  loss curve (inline SVG, a vertical marker at each generation's start, its
  reason as the tooltip) and the step rate, without reloading.
* ``/jobs/{id}/members.json`` — the live members with their ranks in the
  current plan (active or spare, draining) and when each last heartbeat, read
  from its etcd lease (the time left of its liveness lease, so it is the same
  on every replica; whole seconds, for the first `LEASES_SHOWN` members
  only: one etcd read each); the page's members table is refreshed from it
  every second.

An unknown job id is 404 (JSON ``{"error": ..., "job": id}`` for the JSON
endpoints).

The world size comes from the history in etcd (exact, survives leader
changes). The step rate comes from samples of the job's step that the
dashboard takes every ``sample_interval_s`` while this replica leads (kept in
memory, at most ``max_samples`` per job; a new leader starts empty). Access
needs the coordinator's bearer token when it has one (see `metrics.serve`).
Served by every replica (a Service may route to any): a non-leader reads the
same records from etcd, with progress as of the leader's last flush, and says so.
"""

from __future__ import annotations

import html
import io
import json
import re
import threading
import time
from collections import deque

from springback.service.policy import planner
from springback.client import badput
from springback.client.metrics import Page
from springback.client.summary import event_summary, job_summary
from springback.service.core.coordinator import Coordinator
from springback.service.core.jobstate import SERIES_POINTS
from springback.client.errors import NotFound
from springback.service.transport import pages
from springback.service.transport.jobmetrics import goodput

_JOB_PAGE = re.compile(
    r"^/jobs/([a-z0-9-]+)(/world\.svg|/steps\.svg|/series\.json|/members\.json)?$")
LEASES_SHOWN = 64
"""Members whose last heartbeat `members.json` reads (one etcd call each)."""

class Dashboard:
    """The pages, and the step sampler behind the step-rate plot."""

    def __init__(self, coordinator: Coordinator, *, sample_interval_s: float = 2.0,
                 max_samples: int = 1800) -> None:
        self._coordinator = coordinator
        self._interval_s = sample_interval_s
        self._max_samples = max_samples
        self._samples: dict[str, deque[tuple[float, int]]] = {}
        self._lock = threading.Lock()
        self._plot_lock = threading.Lock()  # matplotlib's font cache is shared state
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_loop, name="dashboard", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ends the sampler (idempotent; fine if it never started)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def pages(self) -> dict[str, Page]:
        """The routes for `metrics.serve`."""
        return {"/": self._route}

    # -- sampling ------------------------------------------------------------------

    def _sample_loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 (etcd down, not leader: the next sample retries)
                continue

    def sample(self) -> None:
        """Records (time, step) of every live job (leader only; one etcd read)."""
        if not self._coordinator.election.is_leader():
            with self._lock:
                self._samples.clear()
            return
        now = time.time()
        for job in self._coordinator.list_jobs():
            if planner.is_terminal(job.status.state):
                continue  # its samples stay (until this replica stops leading)
            with self._lock:
                samples = self._samples.setdefault(job.id, deque(maxlen=self._max_samples))
                samples.append((now, job.status.step))

    # -- routing -------------------------------------------------------------------

    def _route(self, path: str) -> tuple[int, str, bytes]:
        path = path.split("?")[0]
        if path == "/live.js":
            return 200, "text/javascript; charset=utf-8", pages.LIVE_JS.encode()
        if path in ("/", "/jobs", "/jobs/"):
            return 200, "text/html; charset=utf-8", self.jobs_page()
        match = _JOB_PAGE.match(path)
        if match is None:
            return 404, "text/plain", b"no such page\n"
        job_id, plot = match.groups()
        try:
            if plot is None:
                return 200, "text/html; charset=utf-8", self.job_page(job_id)
            if plot.endswith(".json"):
                data = self.series(job_id) if plot == "/series.json" else self.members(job_id)
                return 200, "application/json", json.dumps(data).encode()
            return 200, "image/svg+xml", self.plot(job_id, plot.strip("/").removesuffix(".svg"))
        except NotFound as e:
            if plot is not None and plot.endswith(".json"):
                return 404, "application/json", json.dumps({"error": str(e), "job": job_id}).encode()
            return 404, "text/plain", f"{e}\n".encode()

    # -- JSON for the live view -------------------------------------------------------

    def series(self, job_id: str) -> dict:
        """The `series.json` object: ``points`` [[time, step, loss], ...] oldest
        first, ``generations`` [{generation, start_step, time, kind, reason}]."""
        c = self._coordinator
        job = c.get_job(job_id)  # NotFound for an unknown id
        return {
            "job": job_id, "leader": c.election.is_leader(), "max_points": SERIES_POINTS,
            "step": job.status.step, "loss": job.status.loss,
            "points": [[t, step, loss] for t, step, loss in c.series(job_id)],
            "generations": [{"generation": e.generation, "start_step": e.start_step,
                             "time": e.created_at.ToNanoseconds() / 1e9,
                             "kind": event_summary(e)["kind"], "reason": e.reason}
                            for e in c.history.events(job_id)],
        }

    def members(self, job_id: str) -> dict:
        """The `members.json` object: the current plan's active members (by
        node rank, with ranks first..last), then its spares, then live
        members the plan does not name yet (``pending``); with each, its step
        timing's medians (``compute_p50_s``, ``collective_p50_s``: None until
        rank 0 reported them, `JobStatus.member_timing`)."""
        c = self._coordinator
        timing = {t.member_id: t for t in c.get_job(job_id).status.member_timing}  # NotFound: unknown
        live = {m.id: m for m in c.members(job_id)}
        beats = {member_id: self._heartbeat_s_ago(member_id)
                 for member_id in sorted(live)[:LEASES_SHOWN]}
        plan = c.current_plan(job_id)
        rows = []
        named: set[str] = set()

        def row(member_id: str, role: str, host: str, first: int | None, count: int) -> dict:
            m = live.get(member_id)
            named.add(member_id)
            return {"id": member_id, "host": m.host if m else host, "role": role,
                    "first_rank": first, "last_rank": None if first is None else first + count - 1,
                    "num_local_ranks": count or (m.num_local_ranks if m else 0),
                    "draining": bool(m and m.draining), "live": m is not None,
                    "heartbeat_s_ago": beats.get(member_id),
                    "compute_p50_s": timing[member_id].compute_p50_s if member_id in timing else None,
                    "collective_p50_s": (timing[member_id].collective_p50_s
                                         if member_id in timing else None)}

        if plan is not None:
            for pm in sorted(plan.members, key=lambda pm: pm.node_rank):
                rows.append(row(pm.member_id, "active", pm.host, pm.first_rank, pm.num_local_ranks))
            for spare in plan.spares:
                rows.append(row(spare, "spare", "", None, 0))
        for member_id in sorted(set(live) - named):
            rows.append(row(member_id, "pending", "", None, 0))
        return {"job": job_id, "generation": plan.generation if plan else 0, "members": rows}

    def _heartbeat_s_ago(self, member_id: str) -> int | None:
        """Whole seconds since the member's lease was last renewed (granted
        TTL - TTL left); None for a lease this replica does not know, or
        when etcd does not answer."""
        lease = self._coordinator.leases.cached(member_id)
        if lease is None:
            return None
        try:
            left, granted = self._coordinator.store.lease_time_left(lease)
        except Exception:  # noqa: BLE001 (etcd away: the table says "-", the page stays up)
            return None
        return max(granted - left, 0) if left > 0 else None

    # -- pages -----------------------------------------------------------------------

    def _leader_note(self) -> str:
        if self._coordinator.election.is_leader():
            return ""
        return ("<p><b>This replica does not lead: progress is as of the leader's last write "
                "to etcd (at most a few seconds old), and the step rate is not sampled.</b></p>")

    def jobs_page(self) -> bytes:
        jobs = self._coordinator.list_jobs()
        rows = []
        for job in sorted(jobs, key=lambda j: j.created_at.seconds, reverse=True):
            s = job_summary(job)
            ckpt = s["last_checkpoint"]
            rows.append([
                f"<a href='/jobs/{s['id']}'>{s['id']}</a>", html.escape(s["name"]),
                f"<span class='state-{s['state']}'>{s['state']}</span>", str(s["generation"]),
                str(s["world_size"]), f"{s['step']}/{s['max_steps']}", f"{s['loss']:.4f}",
                f"step {ckpt['step']}" if ckpt else "-", pages.ts(job.created_at),
                pages.ts(job.finished_at),
            ])
        table = pages.table(["job", "name", "state", "generation", "world", "step", "loss",
                              "checkpoint", "created", "finished"], rows, "jobs")
        return pages.page("Springback jobs", f"<h1>Springback jobs</h1>{self._leader_note()}"
                          f"<p>{len(rows)} job(s)</p>{table}")

    def job_page(self, job_id: str) -> bytes:
        c = self._coordinator
        job = c.get_job(job_id)
        events = c.history.events(job_id)
        s = job_summary(job)
        now = time.time()
        ratio = goodput(job, events, now)
        total = badput.job_badput(job, events, now)
        meta = pages.table([], [
            ["state", f"<span class='state-{s['state']}'>{s['state']}</span> "
                      f"{html.escape(s['message'])}"],
            ["generation", f"{s['generation']} (world size {s['world_size']})"],
            ["members", html.escape(", ".join(s["members"]) or "-")],
            ["progress", f"step {s['step']}/{s['max_steps']}, loss {s['loss']:.4f}"
                         + (f", <strong class='state-lost'>state lost {s['state_losses']} "
                            f"times ({s['steps_lost']} steps)</strong>"
                            if s["state_losses"] else "")],
            ["goodput", f"<span id='goodput'>{ratio:.1%}</span>" if ratio is not None else "-"],
            ["node-hours", pages.cost_html(total["cost"])],
            ["created / started / finished",
             f"{pages.ts(job.created_at)} / {pages.ts(job.started_at)} / "
             f"{pages.ts(job.finished_at)}"],
        ], "summary").replace("<table", "<table class='meta'", 1)
        timeline = pages.table(
            ["gen", "time", "kind", "world", "restore", "from step", "redone", "recovery", "reason",
             "step time p50 / p90 / p99"],
            [[str(g["generation"]), html.escape(g["time"] or "-"), g["kind"], str(g["world_size"]),
              g["restore"].replace("unspecified", "-"), str(g["start_step"]), str(g["steps_redone"]),
              f"{g['recovery_s']:.2f} s" if g["recovery_s"] is not None else "-",
              html.escape(g["reason"]) + (
                  f" <strong class='state-lost'>state lost ({g['steps_lost']} steps): "
                  f"{html.escape(g['state_lost'] or '')}</strong>" if g["steps_lost"] else ""),
              " / ".join(f"{g['step_time_s'][q] * 1e3:.1f}" for q in ("p50", "p90", "p99"))
              + " ms" if g["step_time_s"] else "-"]
             for g in map(event_summary, reversed(events))],
            "generations")
        checkpoints = pages.table(
            ["step", "generation", "world", "size", "committed", "uri"],
            [[str(r.step), str(r.generation), str(r.world_size), f"{r.size_bytes / 1e6:.1f} MB",
              pages.ts(r.committed_at), html.escape(r.uri)] for r in c.list_checkpoints(job_id)],
            "checkpoints")
        body = (f"<p><a href='/'>all jobs</a></p>{self._leader_note()}<h1>Job {html.escape(job_id)} "
                f"({html.escape(s['name'])})</h1>{meta}"
                f"<h2>World size and step rate</h2><div class='plots'>"
                f"<img id='world-plot' alt='world size over time' src='/jobs/{job_id}/world.svg'>"
                f"<img id='steps-plot' alt='step rate over time' src='/jobs/{job_id}/steps.svg'>"
                f"</div>{pages.LIVE_HTML}{pages.badput_html(job, events, now, total)}"
                f"<h2>Generations</h2>{timeline}"
                f"{pages.recovery_html(events)}<h2>Checkpoints</h2>{checkpoints}")
        # no inline script (the Content-Security-Policy forbids it): /live.js reads the job here
        return pages.page(f"Springback job {job_id}", body + "<script src='/live.js' "
                          f"data-job='{html.escape(job_id)}'></script>")

    # -- plots -----------------------------------------------------------------------

    def plot(self, job_id: str, which: str) -> bytes:
        """An SVG plot of the job: ``world`` (size over time) or ``steps`` (rate)."""
        from matplotlib.figure import Figure  # imported on first use: it is slow to load

        job = self._coordinator.get_job(job_id)
        figure = Figure(figsize=(6, 2.6), dpi=100)
        ax = figure.add_subplot()
        now = time.time()
        if which == "world":
            events = self._coordinator.history.events(job_id)
            times = [e.created_at.ToNanoseconds() / 1e9 for e in events]
            sizes = [e.world_size for e in events]
            end = job.finished_at.ToNanoseconds() / 1e9 if job.finished_at.seconds else now
            if times:
                ax.step([t - times[0] for t in times] + [end - times[0]], sizes + sizes[-1:],
                        where="post")
            ax.set_ylabel("world size (ranks)")
            ax.set_title("world size by generation")
        else:
            with self._lock:
                samples = list(self._samples.get(job_id, ()))
            if len(samples) >= 2:
                t0 = samples[0][0]
                ax.plot([(a[0] + b[0]) / 2 - t0 for a, b in zip(samples, samples[1:])],
                        [max(b[1] - a[1], 0) / max(b[0] - a[0], 1e-9)
                         for a, b in zip(samples, samples[1:])], marker=".")
            ax.set_ylabel("steps / s")
            ax.set_title("step rate (sampled by this replica)")
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
        figure.tight_layout()
        out = io.BytesIO()
        with self._plot_lock:
            figure.savefig(out, format="svg")
        return out.getvalue()
