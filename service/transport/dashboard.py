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
import math
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
from springback.service.transport.jobmetrics import goodput, recovery_times
from springback.v1 import types_pb2 as pb

_JOB_PAGE = re.compile(
    r"^/jobs/([a-z0-9-]+)(/world\.svg|/steps\.svg|/series\.json|/members\.json)?$")
_STYLE = """body{font-family:sans-serif;margin:2em;color:#222}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;font-size:14px}
th{background:#f0f0f0}.plots img{width:560px;margin-right:1em;border:1px solid #ddd}
.state-running{color:#070}#loss-plot{border:1px solid #ddd;background:#fff}
.state-failed{color:#b00}.meta td:first-child{font-weight:bold}
.swatch{display:inline-block;width:10px;height:10px;margin-right:4px}"""

LEASES_SHOWN = 64
"""Members whose last heartbeat `members.json` reads (one etcd call each)."""

CAUSE_COLOURS = {"useful": "#2ca02c", "startup": "#9467bd", "detection": "#d62728",
                 "reforming": "#ff7f0e", "state_transfer": "#1f77b4", "redone": "#8c564b",
                 "checkpoint": "#e377c2", "waiting": "#7f7f7f"}
"""One colour per `badput.CAUSES` entry, shared by the bar and the timeline."""

_LIVE_HTML = """<h2>Live loss</h2>
<p>step rate <b id='step-rate'>-</b>; <span id='live-step'></span> <small id='live-status'>(loading)</small></p>
<svg id='loss-plot' xmlns='http://www.w3.org/2000/svg' width='720' height='260' viewBox='0 0 720 260'
 role='img' aria-label='loss by step'></svg>
<h2>Members</h2><table id='members'><thead><tr><th>member</th><th>host</th><th>ranks</th>
<th>role</th><th>draining</th><th>last heartbeat</th><th>compute p50</th>
<th>collective p50</th></tr></thead><tbody></tbody></table>"""

_LIVE_JS = r"""(function () {
const job = document.currentScript.dataset.job, NS = "http://www.w3.org/2000/svg";
const W = 720, H = 260, L = 60, R = 12, T = 12, B = 34;
function el(name, attrs, parent) {
  const e = document.createElementNS(NS, name);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  parent.appendChild(e);
  return e;
}
function text(name, attrs, parent, content) { el(name, attrs, parent).textContent = content; }
function drawSeries(data) {
  const svg = document.getElementById("loss-plot"), pts = data.points, gens = data.generations;
  svg.replaceChildren();
  svg.setAttribute("data-count", pts.length);
  let x1 = 1, y0 = Infinity, y1 = -Infinity;
  for (const p of pts) { x1 = Math.max(x1, p[1]); y0 = Math.min(y0, p[2]); y1 = Math.max(y1, p[2]); }
  for (const g of gens) x1 = Math.max(x1, g.start_step);
  if (!pts.length) { y0 = 0; y1 = 1; }
  if (y1 - y0 < 1e-9) { y0 -= 0.5; y1 += 0.5; }
  const sx = s => L + (W - L - R) * s / x1, sy = v => T + (H - T - B) * (y1 - v) / (y1 - y0);
  el("rect", {x: L, y: T, width: W - L - R, height: H - T - B, fill: "none", stroke: "#999"}, svg);
  for (let i = 0; i <= 4; i++) {
    const v = y0 + (y1 - y0) * i / 4, s = Math.round(x1 * i / 4);
    el("line", {x1: L, x2: W - R, y1: sy(v), y2: sy(v), stroke: "#eee"}, svg);
    text("text", {x: L - 4, y: sy(v) + 4, "text-anchor": "end", "font-size": 11}, svg, v.toFixed(3));
    text("text", {x: sx(s), y: H - B + 15, "text-anchor": "middle", "font-size": 11}, svg, s);
  }
  text("text", {x: (L + W - R) / 2, y: H - 3, "text-anchor": "middle", "font-size": 12}, svg, "step");
  text("text", {x: 12, y: T + (H - T - B) / 2, "font-size": 12, "text-anchor": "middle",
                transform: `rotate(-90 12 ${T + (H - T - B) / 2})`}, svg, "loss");
  for (const g of gens) {
    const x = sx(g.start_step), m = el("line", {class: "gen-marker", x1: x, x2: x, y1: T, y2: H - B,
      stroke: "#c60", "stroke-width": 2, "stroke-dasharray": "4 3",
      "data-generation": g.generation, "data-step": g.start_step}, svg);
    text("title", {}, m, `generation ${g.generation} (${g.kind}) from step ${g.start_step}: ${g.reason}`);
  }
  el("polyline", {id: "loss-line", fill: "none", stroke: "#1f77b4", "stroke-width": 1.5,
    points: pts.map(p => sx(p[1]).toFixed(1) + "," + sy(p[2]).toFixed(1)).join(" ")}, svg);
  const dots = el("g", {id: "loss-points", fill: "#1f77b4"}, svg);
  for (const p of pts) el("circle", {class: "pt", cx: sx(p[1]).toFixed(2), cy: sy(p[2]).toFixed(2),
    r: 1.6, "data-step": p[1], "data-loss": p[2]}, dots);
  const last = pts[pts.length - 1];
  let first = last;
  for (let i = pts.length - 1; i >= 0 && last[0] - pts[i][0] <= 10; i--) first = pts[i];
  document.getElementById("step-rate").textContent = last && last[0] > first[0]
    ? (Math.max(last[1] - first[1], 0) / (last[0] - first[0])).toFixed(2) + " steps/s" : "-";
  document.getElementById("live-step").textContent = `step ${data.step}, loss ${data.loss.toFixed(4)}`
    + (data.leader ? "" : " (this replica does not lead: no live series)");
}
function drawMembers(data) {
  const rows = data.members.map(m => {
    const tr = document.createElement("tr");
    tr.className = "member-" + m.role;
    for (const c of [m.id, m.host, m.first_rank === null ? "-" : `${m.first_rank}..${m.last_rank}`,
                     m.role, m.draining ? "yes" : "no",
                     m.heartbeat_s_ago === null ? "-" : `${m.heartbeat_s_ago} s ago`,
                     m.compute_p50_s === null ? "-" : `${(m.compute_p50_s * 1e3).toFixed(1)} ms`,
                     m.collective_p50_s === null ? "-"
                       : `${(m.collective_p50_s * 1e3).toFixed(1)} ms`]) {
      const td = document.createElement("td");
      td.textContent = c;
      tr.appendChild(td);
    }
    return tr;
  });
  document.querySelector("#members tbody").replaceChildren(...rows);
}
let busy = false;
async function tick() {
  if (busy) return;
  busy = true;
  const status = document.getElementById("live-status");
  try {
    const [s, m] = await Promise.all(["series", "members"].map(
      n => fetch(`/jobs/${job}/${n}.json`, {cache: "no-store"})));
    if (!s.ok || !m.ok) throw new Error(`HTTP ${s.status}/${m.status}`);
    drawSeries(await s.json());
    drawMembers(await m.json());
    status.textContent = "(live, updated " + new Date().toLocaleTimeString() + ")";
  } catch (e) {
    status.textContent = "(update failed: " + e.message + ")";
  } finally {
    busy = false;
  }
}
tick();
setInterval(tick, 1000);
})();"""


def _page(title: str, body: str) -> bytes:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body>{body}</body></html>").encode()


def _table(headers: list[str], rows: list[list[str]], table_id: str) -> str:
    """A table; `rows` hold HTML (escaped by the caller), `headers` text."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    thead = f"<thead><tr>{head}</tr></thead>" if headers else ""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table id='{table_id}'>{thead}<tbody>{body}</tbody></table>"


def _ts(job_ts) -> str:  # noqa: ANN001 (a protobuf Timestamp)
    return job_ts.ToDatetime().strftime("%Y-%m-%d %H:%M:%S") if job_ts.seconds else "-"


_IN_TIME_ORDER = ("waiting", "startup", "reforming", "state_transfer", "redone", "checkpoint",
                  "useful", "detection")
"""The causes in the order they happen within a generation (the timeline's)."""


def _badput_html(job: pb.Job, events: list, now: float, total: dict) -> str:
    """"Where the time went": the job's wall time as one stacked bar by cause
    (`badput.job_badput`), a table of the causes, and a timeline of the
    generations, each split by its own causes (`badput.per_generation`), all
    as of `now` (the page's ``data-now``, so a reader can recompute them).
    Every shape carries its cause and seconds as ``data-`` attributes;
    `total` is `badput.job_badput` of the same records at `now`."""
    rows = badput.per_generation(job, events, now)
    wall = total["wall_s"]
    if not rows or wall <= 0:
        return "<h2>Where the time went</h2><p id='badput-none'>nothing yet</p>"
    width, height = 720, 28

    def rect(x: float, w: float, cause: str, seconds: float, y: int, h: int, extra: str,
             label: str) -> str:
        return (f"<rect class='cause' x='{x:.2f}' y='{y}' width='{w:.2f}' height='{h}' "
                f"fill='{CAUSE_COLOURS[cause]}' data-cause='{cause}' data-seconds='{seconds:.6f}'"
                f"{extra}><title>{html.escape(label)}</title></rect>")

    x, bar = 0.0, []
    for cause in badput.CAUSES:
        seconds = total["causes"][cause]
        if seconds > 0:
            w = width * seconds / wall
            bar.append(rect(x, w, cause, seconds, 0, height, "",
                            f"{cause}: {seconds:.2f} s ({seconds / wall:.1%})"))
            x += w
    x, timeline, ticks = 0.0, [], []
    for event, seconds, causes in rows:
        gx = x
        for cause in _IN_TIME_ORDER:
            if causes[cause] > 0:
                w = width * causes[cause] / wall
                timeline.append(rect(x, w, cause, causes[cause], 0, 22,
                                     f" data-generation='{event.generation}'",
                                     f"generation {event.generation}: {cause} "
                                     f"{causes[cause]:.2f} s"))
                x += w
        ticks.append(f"<line class='gen-start' x1='{gx:.2f}' x2='{gx:.2f}' y1='0' y2='30' "
                     f"stroke='#333' data-generation='{event.generation}' "
                     f"data-wall='{seconds:.6f}'/><text x='{gx + 2:.2f}' y='40' "
                     f"font-size='10'>{event.generation}</text>")
    legend = _table(["cause", "seconds", "share"], [
        [f"<span class='swatch' style='background:{CAUSE_COLOURS[c]}'></span>{c}",
         f"{total['causes'][c]:.2f}", f"{total['causes'][c] / wall:.1%}"]
        for c in badput.CAUSES], "badput")
    return (f"<h2>Where the time went</h2><p>wall time <b id='badput-wall' "
            f"data-seconds='{wall:.6f}'>{wall:.1f} s</b>, useful "
            f"{total['causes']['useful'] / wall:.1%} (as of this page's load)</p>"
            f"<svg id='badput-bar' data-now='{now:.6f}' xmlns='http://www.w3.org/2000/svg' "
            f"width='{width}' height='{height}'>{''.join(bar)}</svg>{legend}"
            f"<h3>By generation</h3><svg id='badput-timeline' xmlns='http://www.w3.org/2000/svg' "
            f"width='{width}' height='44'>{''.join(timeline)}{''.join(ticks)}</svg>")


def _recovery_html(events: list) -> str:
    """Recovery time (`GenerationEvent.recovery`) by what caused the change:
    count, p50, p90 and the worst, nearest-rank quantiles over the job's
    recoveries (the job's first start is start-up, not recovery)."""
    by_kind: dict[str, list[float]] = {}
    runs = [e for e in events if e.HasField("recovery")][1:]
    for event, seconds in zip(runs, recovery_times(events)):
        by_kind.setdefault(event_summary(event)["kind"], []).append(seconds)

    def q(values: list[float], p: float) -> float:
        ordered = sorted(values)
        return ordered[max(0, math.ceil(len(ordered) * p) - 1)]

    rows = [[kind, str(len(v)), f"{q(v, 0.5):.2f} s", f"{q(v, 0.9):.2f} s", f"{max(v):.2f} s"]
            for kind, v in sorted(by_kind.items())]
    return ("<h2>Recovery by cause</h2>"
            + (_table(["change", "recoveries", "p50", "p90", "max"], rows, "recovery-by-kind")
               if rows else "<p id='recovery-by-kind'>no recovery yet</p>"))


def _cost_html(cost: dict) -> str:
    """Node-hours (active, spares, useful) and, with a price, the money."""
    text = (f"<span id='node-hours'>{cost['node_hours']:.4f}</span> node-hours "
            f"({cost['node_hours_active']:.4f} active, {cost['node_hours_spares']:.4f} spares, "
            f"{cost['node_hours_useful']:.4f} useful)")
    if cost["cost"] is not None:
        per_step = cost["cost_per_useful_step"]
        per_samples = cost["cost_per_1000_samples"]
        text += (f"; cost <b id='cost'>{cost['cost']:.4g}</b> at {cost['price_per_node_hour']:g} "
                 f"per node-hour, <span id='cost-per-step'>"
                 f"{'-' if per_step is None else format(per_step, '.4g')}</span> per useful step, "
                 f"{'-' if per_samples is None else format(per_samples, '.4g')} per 1,000 samples")
    return text


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
            return 200, "text/javascript; charset=utf-8", _LIVE_JS.encode()
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
                f"step {ckpt['step']}" if ckpt else "-", _ts(job.created_at), _ts(job.finished_at),
            ])
        table = _table(["job", "name", "state", "generation", "world", "step", "loss",
                        "checkpoint", "created", "finished"], rows, "jobs")
        return _page("Springback jobs", f"<h1>Springback jobs</h1>{self._leader_note()}"
                     f"<p>{len(rows)} job(s)</p>{table}")

    def job_page(self, job_id: str) -> bytes:
        c = self._coordinator
        job = c.get_job(job_id)
        events = c.history.events(job_id)
        s = job_summary(job)
        now = time.time()
        ratio = goodput(job, events, now)
        total = badput.job_badput(job, events, now)
        meta = _table([], [
            ["state", f"<span class='state-{s['state']}'>{s['state']}</span> "
                      f"{html.escape(s['message'])}"],
            ["generation", f"{s['generation']} (world size {s['world_size']})"],
            ["members", html.escape(", ".join(s["members"]) or "-")],
            ["progress", f"step {s['step']}/{s['max_steps']}, loss {s['loss']:.4f}"
                         + (f", <strong class='state-lost'>state lost {s['state_losses']} "
                            f"times ({s['steps_lost']} steps)</strong>"
                            if s["state_losses"] else "")],
            ["goodput", f"<span id='goodput'>{ratio:.1%}</span>" if ratio is not None else "-"],
            ["node-hours", _cost_html(total["cost"])],
            ["created / started / finished",
             f"{_ts(job.created_at)} / {_ts(job.started_at)} / {_ts(job.finished_at)}"],
        ], "summary").replace("<table", "<table class='meta'", 1)
        timeline = _table(
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
        checkpoints = _table(
            ["step", "generation", "world", "size", "committed", "uri"],
            [[str(r.step), str(r.generation), str(r.world_size), f"{r.size_bytes / 1e6:.1f} MB",
              _ts(r.committed_at), html.escape(r.uri)] for r in c.list_checkpoints(job_id)],
            "checkpoints")
        body = (f"<p><a href='/'>all jobs</a></p>{self._leader_note()}<h1>Job {html.escape(job_id)} "
                f"({html.escape(s['name'])})</h1>{meta}"
                f"<h2>World size and step rate</h2><div class='plots'>"
                f"<img id='world-plot' alt='world size over time' src='/jobs/{job_id}/world.svg'>"
                f"<img id='steps-plot' alt='step rate over time' src='/jobs/{job_id}/steps.svg'>"
                f"</div>{_LIVE_HTML}{_badput_html(job, events, now, total)}<h2>Generations</h2>{timeline}"
                f"{_recovery_html(events)}<h2>Checkpoints</h2>{checkpoints}")
        # no inline script (the Content-Security-Policy forbids it): /live.js reads the job here
        return _page(f"Springback job {job_id}", body + "<script src='/live.js' "
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
