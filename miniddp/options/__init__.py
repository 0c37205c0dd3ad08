"""DDP's options: each in the module named for it, attached to the engine where it says so.

* ``arguments``: torch's constructor signature, and the arguments miniddp refuses by name;
* ``unused``: ``find_unused_parameters`` (and ``skip_all_reduce_unused_params``);
* ``gradient_views``: ``gradient_as_bucket_view``;
* ``batched_copy``: ``batched_grad_copy``;
* ``static_graph``: ``static_graph=True`` / ``_set_static_graph()``;
* ``comm_hooks``: ``register_comm_hook``, and miniddp's own hooks written out;
* ``join``: uneven inputs, ``ddp.join()`` and torch's ``Join``;
* ``pickling``: ``copy.deepcopy`` and pickling, as torch's;
* ``compiled``: ``torch.compile``, where torch's compiler looks for the DDP module.
* ``torch_private``: torch's private attributes and methods, for the code that reads them;
* ``logging_data``: ``_get_ddp_logging_data()``, torch's record of a run;
* ``cpp_warnings``: the warnings torch's C++ reducer prints, printed as it prints them;
* ``optimizer_in_backward``: torch's private ``_apply_optimizer_in_backward``, taken over as
  torch's DDP takes it over.
* ``mixed_classes``: a job whose ranks built torch's DDP on some ranks and miniddp's on others,
  stopped at construction with a message that names the mix.

They import the engine's bucket rules at most; the engine imports them where it attaches them.
"""
