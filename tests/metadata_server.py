"""A local stand-in for a cloud's instance-metadata service (the one fake the
tests allow: a real spot notice cannot be had here), on 127.0.0.1.

`MetadataServer(cloud)` answers the requests `CloudNotice` makes, as the
cloud documents them: AWS IMDSv2 (a PUT for the session token, then the
token required on ``spot/instance-action``: 401 without it, 404 until a
notice), GCP (``instance/preempted`` requires ``Metadata-Flavor: Google``),
Azure Scheduled Events (requires ``Metadata: true``). `preempt()` gives the
notice; `requests` records the paths asked, `broken` makes it answer 500."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class MetadataServer:
    def __init__(self, cloud: str) -> None:
        self.cloud = cloud
        self.preempted = False
        self.broken = False
        self.requests: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _answer(self, code: int, body: str = "") -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:  # noqa: N802
                server.requests.append(f"PUT {self.path}")
                if server.cloud == "aws" and self.path == "/latest/api/token" and \
                        self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return self._answer(200, "token-1")
                self._answer(400)

            def do_GET(self) -> None:  # noqa: N802
                server.requests.append(f"GET {self.path}")
                if server.broken:
                    return self._answer(500, "internal error")
                code, body = server.answer(self.path, self.headers)
                self._answer(code, body)

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        threading.Thread(target=self._http.serve_forever, daemon=True).start()

    def preempt(self) -> None:
        self.preempted = True

    def answer(self, path: str, headers) -> tuple[int, str]:  # noqa: ANN001
        if self.cloud == "aws" and path == "/latest/meta-data/spot/instance-action":
            if headers.get("X-aws-ec2-metadata-token") != "token-1":
                return 401, ""
            if not self.preempted:
                return 404, ""
            return 200, json.dumps({"action": "terminate", "time": "2026-12-03T12:00:00Z"})
        if self.cloud == "gcp" and path == "/computeMetadata/v1/instance/preempted":
            if headers.get("Metadata-Flavor") != "Google":
                return 403, ""
            return 200, "TRUE" if self.preempted else "FALSE"
        if self.cloud == "azure" and path.startswith("/metadata/scheduledevents"):
            if headers.get("Metadata") != "true":
                return 400, ""
            events = [{"EventId": "e1", "EventType": "Freeze", "NotBefore": "soon"}]
            if self.preempted:
                events.append({"EventId": "e2", "EventType": "Preempt", "ResourceType":
                               "VirtualMachine", "NotBefore": "Thu, 03 Dec 2026 12:00:30 GMT"})
            return 200, json.dumps({"DocumentIncarnation": 2, "Events": events})
        return 404, ""

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
