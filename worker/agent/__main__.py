"""``python -m springback.worker.agent …``: the `run` command without the CLI."""

import sys

from springback.worker.agent.command import main

sys.exit(main())
