"""``python -m gateway.cli``: the ``msggateway`` command without its console script."""

import sys

from gateway.cli import main

sys.exit(main())
