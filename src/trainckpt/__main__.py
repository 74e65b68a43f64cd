"""`python -m trainckpt`: the same command as `trainckpt`."""

import sys

from .cli import main

sys.exit(main())
