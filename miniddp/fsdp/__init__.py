"""FSDP (ZeRO-3, and ZeRO-2 as its mode): torch FSDP2's ``fully_shard``, bit for bit on gloo.

Where each part lives, named for torch's modules: ``api`` (``fully_shard``,
``MixedPrecisionPolicy``, the methods of a sharded module), ``init`` (which modules and
parameters a call takes, in torch's order), ``shard`` (one parameter's dim-0 cut and the
DTensor the optimizer sees), ``param`` (one parameter's three forms and its gradient between
micro-batches), ``param_group`` (one unit: gather, free, reduce-scatter, and when), ``state``
(the forward and backward hooks that drive a unit, and ``context``, what the units under one
root share), ``collectives`` (the collectives and the averaging that decides the bits),
``mesh`` (the groups and the DeviceMesh a unit shards over and, under HSDP, replicates across),
``settings`` (torch's other ``FSDPModule`` methods: prefetching, the reduction's settings, and
``register_fsdp_forward_method``) and ``state_dict`` (checkpoints: the sharded state dict torch's
tools take, and full ones). See docs/fsdp.md.
"""

from miniddp.fsdp.api import FSDPModule, MixedPrecisionPolicy, fully_shard
from miniddp.fsdp.mesh import HybridMesh
from miniddp.fsdp.settings import register_fsdp_forward_method
from miniddp.fsdp.state_dict import full_state_dict, load_full_state_dict

__all__ = ["FSDPModule", "HybridMesh", "MixedPrecisionPolicy", "full_state_dict", "fully_shard",
           "load_full_state_dict", "register_fsdp_forward_method"]
