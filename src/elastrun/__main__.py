"""``python -m elastrun``: the same as the ``elastrun`` command."""

import sys

from elastrun.launch.entry import main

sys.exit(main())
