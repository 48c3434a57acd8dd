"""``python -m springback.cli``: the `springback` command."""

import sys

from springback.cli.main import main

sys.exit(main())
