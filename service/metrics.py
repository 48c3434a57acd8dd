"""Prometheus text exposition over HTTP, without a client library.

A `Registry` holds named collectors: functions returning samples at scrape
time, so nothing is updated on hot paths. `serve` runs a daemon HTTP server on
``HOST:PORT`` (port 0 picks a free one) answering ``GET /metrics``.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable, Iterable

Sample = tuple[dict[str, str], float]


class Registry:
    def __init__(self) -> None:
        self._metrics: list[tuple[str, str, str, Callable[[], Iterable[Sample]]]] = []

    def add(self, name: str, kind: str, help_text: str,
            collect: Callable[[], Iterable[Sample] | float]) -> None:
        """Registers `name` (kind 'gauge' or 'counter'); `collect` returns a
        number or (labels, value) samples."""
        def samples() -> Iterable[Sample]:
            value = collect()
            return [({}, float(value))] if isinstance(value, (int, float)) else value

        self._metrics.append((name, kind, help_text, samples))

    def render(self) -> str:
        lines = []
        for name, kind, help_text, samples in self._metrics:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            try:
                for labels, value in samples():
                    label_text = ",".join(
                        f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                        for k, v in sorted(labels.items())
                    )
                    lines.append(f"{name}{{{label_text}}} {value}" if label_text else f"{name} {value}")
            except Exception as e:  # noqa: BLE001 (a scrape must not crash the server)
                lines.append(f"# collect failed: {type(e).__name__}")
        return "\n".join(lines) + "\n"


def serve(registry: Registry, listen: str) -> http.server.ThreadingHTTPServer:
    """Starts the endpoint; returns the server (``server_address`` has the port)."""
    host, _, port = listen.rpartition(":")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server naming)
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404, "only /metrics is served")
                return
            body = registry.render().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer((host or "127.0.0.1", int(port)), Handler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
