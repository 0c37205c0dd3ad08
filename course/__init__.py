"""What runs the course and grades it, kept beside ``lessons/`` so that folder shows the lessons.

``tools`` holds what several lessons share and none teaches (loading an earlier lesson, timing
in alternation, comparing bits); ``runner`` runs every lesson in order
(``python lessons/run_course.py``); ``grader`` grades the exercises against torch
(``python lessons/grade.py``). The two commands stay in ``lessons/``, where a learner looks.
"""
