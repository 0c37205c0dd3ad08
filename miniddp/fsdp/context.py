"""What every unit under one root shares (torch's ``FSDPStateContext``), from the root's first
forward on: the units, whether this backward's final callback is queued, the order of this
forward's post-forwards (for the backward prefetch), the unit whose forward this is, and
whether a profiler records this step (asked once at the root's forward and once at the start
of the backward, not at every unit)."""

from __future__ import annotations


class StateContext:
    def __init__(self):
        self.all_states: list = []  # FSDPState, in named_modules order
        self.callback_queued = False
        self.post_forward_order: list = []  # the groups' post-forwards (ParamGroup)
        #: The unit whose forward holds this forward's others (the root's, but for a unit run
        #: on its own, as in a recomputation), as torch's ``iter_forward_root``
        self.iter_forward_root = None
        self.profiling = False
        self.is_last_backward = True  # ``set_is_last_backward``: False keeps the forward order
