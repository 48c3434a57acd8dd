"""Preemption notices: where a node agent learns that its machine is going away.

A source is anything with ``poll() -> str | None`` returning a reason once the
notice is given. The agent polls every source a few times per second and turns
the first notice (or SIGTERM) into a drain. `FileNotice` is a file a
node-termination handler writes; `CloudNotice` asks a cloud's metadata service
(AWS, GCP, Azure) on a thread of its own, so its `poll` never blocks.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import urllib.error
import urllib.request
from typing import Protocol

log = logging.getLogger("springback.agent")


class PreemptionSource(Protocol):
    def poll(self) -> str | None:
        """A reason once preemption is announced, else None. Must not block."""


class FileNotice:
    """Preempted once `path` exists (e.g. written by a node-termination handler)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def poll(self) -> str | None:
        if os.path.exists(self.path):
            try:
                with open(self.path, encoding="utf-8", errors="replace") as f:
                    text = f.read(200).strip()
            except OSError:
                text = ""
            return f"preemption notice {self.path}" + (f": {text}" if text else "")
        return None


CLOUDS = ("aws", "gcp", "azure")
"""The metadata services a `CloudNotice` knows."""

CLOUD_ENDPOINTS = {"aws": "http://169.254.169.254", "gcp": "http://metadata.google.internal",
                   "azure": "http://169.254.169.254"}
"""Each cloud's instance-metadata address (reachable only from the instance)."""

CLOUD_POLL_S = 1.0
"""How often a `CloudNotice` asks: the clouds give 30 s (Azure, GCP) to 2 min
(AWS) of notice, so a second is noise in the drain's budget."""

CLOUD_TIMEOUT_S = 0.5
"""Per request: a metadata service answers in milliseconds or not at all."""


class CloudNotice:
    """A cloud's spot / preemption notice, from its instance-metadata service,
    asked every `CLOUD_POLL_S` on a thread of its own (so `poll` never blocks):

    * ``aws``: IMDSv2 (a session token from ``PUT /latest/api/token``, then
      ``GET /latest/meta-data/spot/instance-action``: 404 until a stop or
      terminate is scheduled, then JSON with its action and time);
    * ``gcp``: ``GET /computeMetadata/v1/instance/preempted`` with
      ``Metadata-Flavor: Google``: ``TRUE`` once preempted;
    * ``azure``: Scheduled Events (``GET /metadata/scheduledevents`` with
      ``Metadata: true``): an event of type ``Preempt`` or ``Terminate``.

    `endpoint` replaces the cloud's metadata address (a proxy, or a test's
    server). A service that does not answer or answers nonsense is logged once
    per kind of failure and asked again: only a notice drains the node."""

    def __init__(self, cloud: str, endpoint: str | None = None) -> None:
        if cloud not in CLOUDS:
            raise ValueError(f"--preemption-cloud must be one of {', '.join(CLOUDS)}, "
                             f"got {cloud!r}")
        self.cloud = cloud
        self.endpoint = (endpoint or CLOUD_ENDPOINTS[cloud]).rstrip("/")
        self._reason: str | None = None
        self._failures: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"preemption-{cloud}")
        self._thread.start()

    def poll(self) -> str | None:
        return self._reason

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while self._reason is None and not self._stop.is_set():
            try:
                notice = getattr(self, f"_ask_{self.cloud}")()
            except (OSError, ValueError) as e:  # unreachable, refused, malformed
                kind = type(e).__name__
                if kind not in self._failures:
                    self._failures.add(kind)
                    log.warning("preemption notices from %s at %s: %s (asking again every "
                                "%.0f s)", self.cloud, self.endpoint, e, CLOUD_POLL_S)
                notice = None
            if notice:
                self._reason = f"{self.cloud} preemption notice: {notice}"
                return
            self._stop.wait(CLOUD_POLL_S)

    def _get(self, path: str, headers: dict[str, str], method: str = "GET") -> str | None:
        """The body of a 2xx answer; None for a 404 (no notice)."""
        req = urllib.request.Request(self.endpoint + path, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=CLOUD_TIMEOUT_S) as resp:  # noqa: S310
                return resp.read(65536).decode("utf-8", errors="replace")
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise

    def _ask_aws(self) -> str | None:
        token = self._get("/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "60"},
                          method="PUT")
        if not token:
            raise ValueError("IMDSv2 gave no session token")
        body = self._get("/latest/meta-data/spot/instance-action",
                         {"X-aws-ec2-metadata-token": token.strip()})
        if body is None:
            return None
        action = json.loads(body)
        if not isinstance(action, dict):
            raise ValueError(f"instance-action is not a JSON object: {body[:80]!r}")
        return f"spot instance-action {action.get('action', '?')} at {action.get('time', '?')}"

    def _ask_gcp(self) -> str | None:
        body = self._get("/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"})
        return "instance preempted" if body is not None and body.strip().upper() == "TRUE" \
            else None

    def _ask_azure(self) -> str | None:
        body = self._get("/metadata/scheduledevents?api-version=2020-07-01", {"Metadata": "true"})
        if body is None:
            return None
        document = json.loads(body)
        events = document.get("Events") if isinstance(document, dict) else None
        if not isinstance(events, list):
            raise ValueError(f"scheduled events have no Events list: {body[:80]!r}")
        ending = [e for e in events if isinstance(e, dict)
                  and e.get("EventType") in ("Preempt", "Terminate")]
        if not ending:
            return None
        e = ending[0]
        return f"scheduled event {e.get('EventType')} not before {e.get('NotBefore', '?')}"
