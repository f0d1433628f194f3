"""`python -m kvstore.service`: the same as `kvtier serve`."""

import sys

from kvstore.service.serve import main

sys.exit(main())
