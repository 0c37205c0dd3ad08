"""Grade the exercises in lessons/exercises/ bit for bit against torch (``--help`` for how).

The grader itself is ``course/grader/``; this file starts it from where a learner looks.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # before torch: its C++ notes bury grades
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # course/ sits beside lessons/
from course.grader.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
