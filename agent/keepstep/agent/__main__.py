"""`python -m keepstep.agent` is the `keepstep` command."""

import sys

from keepstep.agent.cli import main

sys.exit(main())
