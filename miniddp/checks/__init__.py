"""Checks and traces: what DDP looks like from the inside, and what catches ranks out of step.

* ``consistency``: replicas that drift apart, ranks that fall out of step, failed waits
  explained, late gradients (``TORCH_DISTRIBUTED_DEBUG``, ``ddp.check_every(n)``);
* ``ledger``: the store where ranks write what they are doing; ``fingerprints``: every
  collective compared before it runs; ``out_of_step``: the messages;
* ``trace``: ``ddp.trace()``, the reducer's events on a timeline; ``chrome_trace``: every rank's
  events as one Chrome trace (the JSON Perfetto and chrome://tracing open);
* ``bits``: same bits? (dtype, shape and every bit: the same NaN is equal, 0.0 and -0.0 are not),
  the one comparison the tests, the benchmarks and the course make.

The engine imports none of this. The checks attach to a reducer's events: ``miniddp.ddp`` gives
each new reducer its ``watch`` (and, when switched on, its ``consistency``) through
``consistency.attach``, and ``ddp.check_every`` and ``ddp.trace`` call in here.
"""
