"""``python -m kvscope.cli``: the ``kvscope`` command."""

import sys

from kvscope.cli import main

sys.exit(main())
