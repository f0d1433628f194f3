"""`python -m kvstore.service`: the same as `kvtier serve`."""

import sys

from kvstore.service.cli import main

sys.exit(main())
