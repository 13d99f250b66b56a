"""compactor: the process-level glue (CLI, Redis keys, the embedded server, job queue names).

``events`` is the domain; ``producer`` puts work in; ``worker`` runs the jobs. The
modules here are the small shared vocabulary between producer and worker.
"""

__version__ = "0.1.0"
