"""`python -m keepstep` is the `keepstep` command."""

import sys

from keepstep.cli import main

sys.exit(main())
