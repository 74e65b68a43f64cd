"""`python -m trainckpt`: the same command as `trainckpt`."""

import sys

from trainckpt.cli.main import main

sys.exit(main())
