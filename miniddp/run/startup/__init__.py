"""Not imported as a package: this directory goes on a child's ``PYTHONPATH`` so that the child
runs its ``sitecustomize.py`` at start-up (``miniddp.run.children``)."""
