"""``python -m pushkv.protocol.check``: see :func:`pushkv.protocol.check.main`."""

import sys

from . import main

sys.exit(main())
