"""The goodput benchmark's PNG timeline: each system's completed step over
time since its nodes were started, one line per system, its kills marked."""

from __future__ import annotations

from typing import Any


def timeline(results: list[dict], args: Any, path: str) -> None:
    """Writes the timeline of `results` (goodput.py's side records) to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    for r in results:
        xs = [s["t"] - r["t0"] for s in r["steps"]]
        line, = ax.plot(xs, [s["step"] for s in r["steps"]], ".", markersize=1.5,
                        label=r["system"])
        for t in r.get("kill_times", []):
            ax.axvline(t - r["t0"], color=line.get_color(), alpha=0.35, linewidth=0.8)
    ax.set_xlabel("seconds since the nodes were started")
    ax.set_ylabel("step completed")
    ax.set_title(f"{args.nodes} nodes, SIGKILL every {args.kill_every_s:g} s, replacement "
                 f"{args.replace_after_s:g} s later (vertical lines: kills)", fontsize=9)
    ax.legend(markerscale=8, fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
