"""`python -m simengine` = the `simengine` command."""

import sys

from simengine.cli import main

sys.exit(main())
