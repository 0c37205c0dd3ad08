"""The naive versions, kept callable so lessons and benchmarks compare against them.

* ``data_parallel``: single-process ``DataParallel`` (scatter, replicate, gather);
* ``naive``: all_reduce each parameter after backward, or buckets after backward (no overlap).
"""
