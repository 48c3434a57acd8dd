"""The dashboard's HTML (`dashboard`): the page frame and its style, the
job page's live section and the script that fills it (served as ``/live.js``:
the listener's Content-Security-Policy forbids inline scripts), tables, and
the job page's sections drawn from the history: where the time went
(badput by cause), recovery by cause, node-hours and cost. Pure rendering:
no I/O, every figure passed in.
"""

from __future__ import annotations

import html
import math

from springback.client import badput
from springback.client.summary import event_summary
from springback.service.transport.jobmetrics import recovery_times
from springback.v1 import types_pb2 as pb

STYLE = """body{font-family:sans-serif;margin:2em;color:#222}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;font-size:14px}
th{background:#f0f0f0}.plots img{width:560px;margin-right:1em;border:1px solid #ddd}
.state-running{color:#070}#loss-plot{border:1px solid #ddd;background:#fff}
.state-failed{color:#b00}.meta td:first-child{font-weight:bold}
.swatch{display:inline-block;width:10px;height:10px;margin-right:4px}"""

CAUSE_COLOURS = {"useful": "#2ca02c", "startup": "#9467bd", "detection": "#d62728",
                 "reforming": "#ff7f0e", "state_transfer": "#1f77b4", "redone": "#8c564b",
                 "checkpoint": "#e377c2", "waiting": "#7f7f7f"}
"""One colour per `badput.CAUSES` entry, shared by the bar and the timeline."""

LIVE_HTML = """<h2>Live loss</h2>
<p>step rate <b id='step-rate'>-</b>; <span id='live-step'></span> <small id='live-status'>(loading)</small></p>
<svg id='loss-plot' xmlns='http://www.w3.org/2000/svg' width='720' height='260' viewBox='0 0 720 260'
 role='img' aria-label='loss by step'></svg>
<h2>Members</h2><table id='members'><thead><tr><th>member</th><th>host</th><th>ranks</th>
<th>role</th><th>draining</th><th>last heartbeat</th><th>compute p50</th>
<th>collective p50</th></tr></thead><tbody></tbody></table>"""

LIVE_JS = r"""(function () {
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


def page(title: str, body: str) -> bytes:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>{body}</body></html>").encode()


def table(headers: list[str], rows: list[list[str]], table_id: str) -> str:
    """A table; `rows` hold HTML (escaped by the caller), `headers` text."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    thead = f"<thead><tr>{head}</tr></thead>" if headers else ""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table id='{table_id}'>{thead}<tbody>{body}</tbody></table>"


def ts(job_ts) -> str:  # noqa: ANN001 (a protobuf Timestamp)
    return job_ts.ToDatetime().strftime("%Y-%m-%d %H:%M:%S") if job_ts.seconds else "-"


IN_TIME_ORDER = ("waiting", "startup", "reforming", "state_transfer", "redone", "checkpoint",
                  "useful", "detection")
"""The causes in the order they happen within a generation (the timeline's)."""


def badput_html(job: pb.Job, events: list, now: float, total: dict) -> str:
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
        for cause in IN_TIME_ORDER:
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
    legend = table(["cause", "seconds", "share"], [
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


def recovery_html(events: list) -> str:
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
            + (table(["change", "recoveries", "p50", "p90", "max"], rows, "recovery-by-kind")
               if rows else "<p id='recovery-by-kind'>no recovery yet</p>"))


def cost_html(cost: dict) -> str:
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
