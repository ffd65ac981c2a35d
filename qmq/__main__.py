"""``python -m qmq`` runs the CLI."""

import sys

from qmq.cli import main

sys.exit(main())
