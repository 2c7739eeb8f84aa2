"""``python -m fsdp2_compat.cli``: the ``fsdp2-compat`` command."""

import sys

from . import main

sys.exit(main())
