"""The reference training job, and what it is made of: ``python -m miniddp.train``.

* ``job``: the training loop (DDP, the sampler, snapshots, a resume that changes nothing);
* ``checkpoint``: atomic snapshots of model, optimizer, sampler position and random state;
* ``job_files``: where a job's snapshots and outputs live, checked before any rank starts;
* ``faults``: faults injected on purpose (a killed rank, a stall, drift);
* ``data``: the synthetic teacher task and the student model (the lessons' ``course/data.py``
  takes them from here);
* ``report``: printing on rank 0, the loss averaged over ranks (the lessons' checks, progress
  and plots are ``course/report.py``).
"""

from miniddp.train.job import main, parse_args, train

__all__ = ["main", "parse_args", "train"]
