"""Break one mechanism of miniddp or torch in every Python process started with this on its path.

``tests/course/test_lesson_breakage.py`` puts this directory on ``PYTHONPATH`` and names a breakage
of
:mod:`breakages` in ``MINIDDP_BREAK``. Python imports ``sitecustomize`` at start-up, so the lesson,
the ranks it forks, a torchrun agent and the workers that agent starts are all broken alike,
without a line of the lesson changed.
"""

import os

if os.environ.get("MINIDDP_BREAK"):
    import breakages

    breakages.apply(os.environ["MINIDDP_BREAK"])
