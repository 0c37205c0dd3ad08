"""``python -m miniddp.train``: run the reference job (``miniddp.train.job``)."""

import sys

from miniddp.train.job import main

sys.exit(main())
