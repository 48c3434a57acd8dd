"""A library-mode script that proves it started (it writes the file named by
MARKER_FILE at once), then trains nothing: it follows its generations like
any Session script, so it blocks while the job does not run."""

import os

open(os.environ["MARKER_FILE"], "w").close()

from springback.worker import Session  # noqa: E402

session = Session()
for gen in session.generations():
    with gen:
        for _batch in gen.batches():
            pass
