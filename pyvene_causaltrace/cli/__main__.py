"""``python -m pyvene_causaltrace.cli``: the command line (torchrun starts it this way)."""

import sys

from . import main

sys.exit(main())
