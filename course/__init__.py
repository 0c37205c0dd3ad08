"""What runs the course and grades it, kept beside ``lessons/`` so that folder shows the lessons.

``report`` is what a lesson shows and how it proves itself (``print0``, ``check``, ``ok``,
progress, pictures), ``data`` the task it learns and each rank's shard; ``tools`` holds what
several lessons share and none teaches (loading an earlier lesson, timing in alternation: the
benchmarks' timer too); ``runner`` runs every lesson in order
(``python lessons/run_course.py``); ``grader`` grades the exercises against torch
(``python lessons/grade.py``). The two commands stay in ``lessons/``, where a learner looks.
"""
