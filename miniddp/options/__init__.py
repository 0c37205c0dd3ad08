"""DDP's options: what a user of torch's DDP turns on, each in the module named for it, attached
to the reducer by ``miniddp.ddp`` (the engine imports none of them). Each acts at the line of the
reducer's step that it changes, and that line names the module.

* ``unused``: ``find_unused_parameters`` (and ``skip_all_reduce_unused_params``);
* ``gradient_views``: ``gradient_as_bucket_view``;
* ``static_graph``: ``static_graph=True`` / ``_set_static_graph()``;
* ``comm_hooks``: ``register_comm_hook``, and miniddp's own hooks written out;
* ``join``: uneven inputs, ``ddp.join()`` and torch's ``Join``;
* ``create_graph``: ``backward(create_graph=True)``, as torch's reducer handles it.

``batched_grad_copy`` needs no module: it is a flag of the reducer's own deferred copy
(``Reducer.copy_buckets_at_end``). torch's compatibility is ``miniddp.compat``.
"""
