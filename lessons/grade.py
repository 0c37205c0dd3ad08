"""Grade the exercises in lessons/exercises/ bit for bit against torch (``--help`` for how).

The grader itself is ``course/grader/``; this file starts it from where a learner looks.
"""

import os
import sys
from pathlib import Path

# Before torch loads: its C++ note that find_unused_parameters found nothing unused (exercise 05
# uses that flag for its buckets) would bury the grades. Here, not in the grader's modules, which
# tests import into processes whose warnings they check.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # course/ sits beside lessons/
from course.grader.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
