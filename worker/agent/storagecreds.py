"""A job's storage credentials, handed to its agent as a file
(``springback run --storage-credentials FILE`` /
``$SPRINGBACK_STORAGE_CREDENTIALS_FILE``) and to its ranks only.

The file holds ``AWS_*=VALUE`` lines (what botocore reads: e.g.
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_REGION``, ``AWS_ENDPOINT_URL``); blank lines and ``#`` comments are
skipped, values are taken verbatim (no quotes, no expansion). It must be a
regular file of this user that nobody else can read (mode 0600 or 0400: what
systemd's ``LoadCredential=`` gives a service).

`apply` makes the file's the only credentials in the environment of the agent
(its own rank-log uploads) and so of every rank it starts
(`node.Agent._rank_env` copies the agent's environment): every ``AWS_*``
variable the agent inherited is dropped (a node-wide key, another job's, a
profile, a credentials or config file, a role or container-credentials
source) but the few `SETTINGS` that carry no credential (a CA bundle, the
region, the endpoint, retries), and the file's path is removed too, so a rank
is told of no credentials but its job's. Kept names are listed, not dropped
ones: a credential source botocore adds later is dropped too. docs/security.md ("Storage credentials per job")
says what this does not close: a process of the same Unix user can still read
another process's ``/proc/<pid>/environ``.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import MutableMapping

from springback.client import env as E

FLAG = f"--storage-credentials (${E.STORAGE_CREDENTIALS_FILE})"
_NAME = re.compile(r"AWS_[A-Z0-9_]+")
SETTINGS = re.compile(r"AWS_(CA_BUNDLE|REGION|DEFAULT_REGION|ENDPOINT_URL(_[A-Z0-9_]+)?|"
                      r"EC2_METADATA_DISABLED|MAX_ATTEMPTS|RETRY_MODE|USE_FIPS_ENDPOINT|"
                      r"USE_DUALSTACK_ENDPOINT)")
"""Inherited ``AWS_*`` variables `apply` keeps: settings, no credential."""


def read(path: str) -> dict[str, str]:
    """The ``AWS_*`` variables of the credentials file at `path`. Raises
    ValueError naming the flag and the file when it cannot be read, another
    user owns it, others can read it, or a line is not ``AWS_NAME=VALUE``."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise ValueError(f"{FLAG}: {path!r} cannot be read: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{FLAG}: {path!r} is not a regular file")
        if st.st_uid != os.getuid():
            raise ValueError(f"{FLAG}: {path!r} belongs to uid {st.st_uid}, not to this user "
                             f"({os.getuid()})")
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise ValueError(f"{FLAG}: {path!r} has mode {stat.S_IMODE(st.st_mode):o}: others "
                             f"can read the storage credentials; chmod 600 it")
        with open(fd, "rb", closefd=False) as f:
            raw = f.read()
    finally:
        os.close(fd)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{FLAG}: {path!r} is not UTF-8 text") from None
    values: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep or not _NAME.fullmatch(name):  # the line itself may hold a secret: not shown
            raise ValueError(f"{FLAG}: {path!r} line {number} is not AWS_NAME=VALUE")
        values[name] = value.strip()
    if not values:
        raise ValueError(f"{FLAG}: {path!r} holds no AWS_NAME=VALUE line")
    return values


def apply(path: str, environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Reads `path` (`read`) and sets its variables in `environ`, dropping
    every other ``AWS_*`` one but `SETTINGS`; `environ` then names no
    credentials file. Returns the names set."""
    values = read(path)
    for name in [n for n in environ if n.startswith("AWS_") and not SETTINGS.fullmatch(n)]:
        del environ[name]
    environ.pop(E.STORAGE_CREDENTIALS_FILE, None)
    environ.update(values)
    return sorted(values)
