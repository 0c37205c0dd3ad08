"""Run every lesson in order, then a table of results (``--help`` for how).

The runner itself is ``course/runner.py``; this file starts it from where a learner looks.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # course/ sits beside lessons/
from course.runner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
