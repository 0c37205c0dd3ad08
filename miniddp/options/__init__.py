"""DDP's options and torch's compatibility, each in the module named for it, attached to the
engine's seams by ``miniddp.ddp`` (the engine imports none of them).

DDP's features:

* ``unused``: ``find_unused_parameters`` (and ``skip_all_reduce_unused_params``);
* ``gradient_views``: ``gradient_as_bucket_view``;
* ``batched_copy``: ``batched_grad_copy``;
* ``static_graph``: ``static_graph=True`` / ``_set_static_graph()``;
* ``comm_hooks``: ``register_comm_hook``, and miniddp's own hooks written out;
* ``join``: uneven inputs, ``ddp.join()`` and torch's ``Join``.

torch's compatibility:

* ``arguments``: torch's constructor signature, and the arguments miniddp refuses by name;
* ``create_graph``: ``backward(create_graph=True)``, as torch's reducer handles it;
* ``pickling``: ``copy.deepcopy`` and pickling, as torch's;
* ``compiled``: ``torch.compile``, where torch's compiler looks for the DDP module;
* ``torch_private``: torch's private attributes and methods, for the code that reads them;
* ``logging_data``: ``_get_ddp_logging_data()``, torch's record of a run;
* ``cpp_warnings``: the warnings torch's C++ reducer prints, printed as it prints them;
* ``optimizer_in_backward``: torch's private ``_apply_optimizer_in_backward``, taken over as
  torch's DDP takes it over.

They may import the engine; the engine imports none of them.
"""
