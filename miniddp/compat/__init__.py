"""torch's DDP object, as torch's own code and other libraries read it: nothing here changes how
gradients are averaged, only how much miniddp's class looks like torch's.

* ``arguments``: torch's constructor signature, release by release, and the arguments miniddp
  refuses by name;
* ``torch_private``: torch's private attributes and methods (buffer hooks, built-in comm hooks,
  the reducer's used-parameter map), for the code that reads them;
* ``logging_data``: ``_get_ddp_logging_data()``, torch's record of a run;
* ``pickling``: ``copy.deepcopy`` and pickling, as torch's;
* ``compiled``: ``torch.compile``, where torch's compiler looks for the DDP module;
* ``optimizer_in_backward``: torch's private ``_apply_optimizer_in_backward``, taken over as
  torch's DDP takes it over.

``miniddp.ddp`` composes them onto the engine's class; they may import the engine and DDP's
options (``miniddp.options``), and neither imports them.
"""
