"""Runnable example scripts and importable worker functions for notebook 06.

Scripts (run them under a launcher; ``course_lib.dist.example_path(name)`` gives their path):

- ``hello_dist.py``: joins the group with ``init_distributed_mode`` (torchrun, mpirun, Slurm or
  none), checks ``dist.all_reduce`` against the hand-written ring, prints one JSON line per rank.

Workers for ``course_lib.dist.launch`` live in ``workers.py``: ``launch`` starts fresh processes
that import the function by name, so it cannot be defined in a notebook cell.
"""
