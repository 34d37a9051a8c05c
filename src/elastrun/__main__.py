"""``python -m elastrun``: the same as the ``elastrun`` command."""

import sys

from elastrun.launch.main import main

sys.exit(main())
