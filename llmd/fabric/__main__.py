"""`python -m llmd.fabric ...`: see llmd.fabric.bootstrap."""

import sys

from llmd.fabric.bootstrap import main

sys.exit(main())
