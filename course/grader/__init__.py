"""The grader of ``lessons/exercises/``: ``cli`` is ``python lessons/grade.py``; ``checks`` runs
a learner's code on forked gloo ranks; each other module grades one exercise; ``hints`` holds
the hints in three steps."""
