"""``python -m cupy_flash {info,warmup,check,bench}``; see cupy_flash._cli."""

import sys

from ._cli import main

sys.exit(main())
