"""Breakages of miniddp's sharded optimizer (``miniddp/optim``) and FSDP (``miniddp/fsdp``), each
small, each of a mechanism lessons 15 and 17 teach; registered in ``breakages.BREAKAGES``.

``tests/course/test_zero_course.py`` and ``tests/course/test_fsdp_course.py`` apply each in a pool
of ranks
and run the lesson's part that proves the mechanism (it must fail there, with its check's
message); ``tests/course/test_lesson_breakage.py`` runs whole lessons with some of them.
"""

from __future__ import annotations

import contextlib

import breakages

# ----- miniddp/optim: ZeRO stage 1 -----


def _partition(order, measure):
    """A partition like torch's, but taking the parameters in ``order`` and measuring a rank's
    load with ``measure``."""
    from miniddp.optim.partition import lightest, with_params

    def partition(param_groups, world_size):
        per_rank, load = [[] for _ in range(world_size)], [0] * world_size
        for group in param_groups:
            owned = [[] for _ in range(world_size)]
            for p in order(group["params"]):
                rank = lightest(load)
                owned[rank].append(p)
                load[rank] += measure(p)
            for rank in range(world_size):
                per_rank[rank].append(with_params(group, owned[rank]))
        return per_rank
    return partition


def zero_partition_by_count(module):
    """Lesson 15: ZeRO balances the number of parameters each rank owns, not their elements."""
    by_size = lambda params: sorted(params, key=lambda p: p.numel(), reverse=True)  # noqa: E731
    breakages._patch(module, "greedy_by_size", lambda original: _partition(by_size, lambda p: 1))


def zero_partition_in_model_order(module):
    """Lesson 15: ZeRO gives out the parameters in model order instead of largest first."""
    breakages._patch(module, "greedy_by_size",
                     lambda original: _partition(list, lambda p: p.numel()))


def zero_steps_every_parameter(module):
    """Lesson 15: each rank's local optimizer steps (and keeps the state of) every parameter:
    the same bits, none of the memory saved."""
    def everything(original):
        def init(self):
            self.optim = self._optim_constructor(self.param_groups, **self._optim_defaults)
        return init
    breakages._patch(module.ZeroRedundancyOptimizer, "_init_local_optimizer", everything)


def zero_broadcasts_from_rank_0(module):
    """Lesson 15: every share is broadcast from rank 0, not from the rank that stepped it."""
    import torch.distributed as dist

    def from_rank_0(original):
        def sync(self, *_profiled):
            for rank in range(self.world_size):
                for group in self._partition_parameters()[rank]:
                    for p in group["params"]:
                        dist.broadcast(p.data, src=0, group=self.process_group)
        return sync
    breakages._patch(module.ZeroRedundancyOptimizer, "_sync_params", from_rank_0)


def zero_never_sends(module):
    """Lesson 15: the updated shares never leave their owners."""
    breakages._patch(module.ZeroRedundancyOptimizer, "_sync_params",
                     lambda original: lambda self, *_profiled: None)


# ----- miniddp/fsdp -----


def fsdp_fp16_like_fp32(module):
    """Lesson 17: fp16 gradients are summed whole, then divided by W (AVG's arithmetic),
    instead of torch's split: a power of two before the sum, the rest after."""
    breakages._patch(module, "fp16_divide_factors", lambda original: lambda world: (1, world))


def fsdp_fp16_factors_halved_once(module):
    """Lesson 17, part 2: fp16 divided by 2 before the sum whatever the world size, the rest
    after (right at 2, 3, 4, 5 and 7 ranks; wrong at 6 and 8, beyond the lesson's runs)."""
    breakages._patch(module, "fp16_divide_factors",
                     lambda original: lambda world: (1, 1) if world < 2 else (2, world / 2))


def fsdp_root_resharded(module):
    """Lesson 17: the root frees its parameters after forward like any unit (torch keeps the
    root's: the backward needs them first)."""
    def keep_the_users_choice(original):
        def lazy_init(self):
            group = self.group
            choice = None if group is None else group.reshard_after_forward
            original(self)
            if group is not None:
                group.reshard_after_forward = choice
        return lazy_init
    breakages._patch(module.FSDPState, "_lazy_init", keep_the_users_choice)


@contextlib.contextmanager
def _resharding(group, value):
    kept = group.reshard_after_forward
    group.reshard_after_forward = value
    try:
        yield
    finally:
        group.reshard_after_forward = kept


def fsdp_never_frees_after_forward(module):
    """Lesson 17: under ZeRO-3 a unit keeps its parameters gathered after forward (ZeRO-2's
    memory: the freeing and the second gather never happen)."""
    def kept(original):
        def post_forward(self, module_, args, output):
            if self.group is None:
                return original(self, module_, args, output)
            with _resharding(self.group, False):
                return original(self, module_, args, output)
        return post_forward
    breakages._patch(module.FSDPState, "_post_forward", kept)


def fsdp_zero2_ignored(module):
    """Lessons 15 and 17: ``reshard_after_forward=False`` is ignored: ZeRO-2 frees after forward
    and gathers again for backward, as ZeRO-3 does."""
    def always(original):
        def init(self, params, reshard_after_forward, *mesh):
            original(self, params, True, *mesh)
        return init
    breakages._patch(module.ParamGroup, "__init__", always)


def fsdp_no_gather_for_backward(module):
    """Lesson 17: the pre-backward does not gather a freed unit again: its backward reads
    parameters whose memory is gone."""
    breakages._patch(module.ParamGroup, "pre_backward",
                     lambda original: lambda self, *args, **kwargs: None)


def fsdp_gradient_overwritten(module):
    """Lesson 17: a second backward with sync before the step replaces the shard's ``.grad``
    instead of adding to it."""
    def replaced(original):
        def add_sharded_grad(self, local):
            self.sharded.grad = module.as_dtensor(local, self.dspec)
        return add_sharded_grad
    breakages._patch(module.FSDPParam, "add_sharded_grad", replaced)


def fsdp_sync_always(module):
    """Lesson 17: ``set_requires_gradient_sync(False)`` is ignored: every backward reduces."""
    def synced(original):
        def post_backward(self):
            self.requires_gradient_sync = True
            return original(self)
        return post_backward
    breakages._patch(module.ParamGroup, "post_backward", synced)


def fsdp_kept_in_compute_dtype(module):
    """Lesson 17: without sync, the full gradients add up in the compute dtype (bf16) instead of
    the reduction's (fp32), as torch keeps them."""
    def in_compute_dtype(original):
        return lambda self: None  # left in .grad, where autograd adds the next one, in bf16
    breakages._patch(module.FSDPParam, "to_accumulated_grad_if_needed", in_compute_dtype)


def fsdp_reduce_dtype_ignored(module):
    """Lesson 17: ``MixedPrecisionPolicy.reduce_dtype`` is ignored: gradients are averaged in
    the compute dtype (bf16) instead of fp32."""
    def without(original):
        def init(self, param, owners, fqn, param_dtype, reduce_dtype, *mesh):
            original(self, param, owners, fqn, param_dtype, None, *mesh)
        return init
    breakages._patch(module.FSDPParam, "__init__", without)


def fsdp_frozen_after_sharding_ignored(module):
    """Lesson 17, part 2: a parameter frozen after ``fully_shard`` is gathered still needing a
    gradient, so its gradient is computed and reduced (the shard's flag is not followed)."""
    breakages._patch(module.FSDPParam, "to_unsharded",
                     lambda original: lambda self: self.register(self.unsharded))


def fsdp_full_state_dict_keeps_padding(module):
    """Lesson 17, part 3: a full state dict gathered with every rank's padded rows, so a
    parameter cut unevenly comes back with zero rows at its end."""
    import torch
    import torch.distributed as dist

    def padded(original):
        def full_state_dict(model):
            world, state = dist.get_world_size(), original(model)
            for key, value in state.items():
                if value.dim() and value.shape[0] % world:
                    pad = world - value.shape[0] % world
                    state[key] = torch.cat([value, value.new_zeros(pad, *value.shape[1:])])
            return state
        return full_state_dict
    breakages._patch(module, "full_state_dict", padded)


def fsdp_checkpoint_rows_as_plain_tensors(module):
    """Lesson 17, part 3: a sharded model's ``state_dict`` holds each rank's rows as plain
    tensors (what miniddp did before its shards were DTensors): DCP writes one copy of each."""
    def with_plain_rows(original):
        def register_hooks(group):
            original(group)

            def plain_rows(_module, state, prefix, _metadata):
                for key, value in state.items():
                    if key.startswith(prefix) and hasattr(value, "to_local"):
                        state[key] = value.to_local()
            for p in group.params:
                for owner, _ in p.owners:
                    owner._register_state_dict_hook(plain_rows)
        return register_hooks
    breakages._patch(module, "register_hooks", with_plain_rows)


# ----- miniddp/fsdp: HSDP (lesson 18; tests/fsdp/test_hsdp.py's negative controls) -----


def _one_division(c, buffer, mesh, partial, all_reduce):
    import torch.distributed as dist

    output = c.reduce_scatter_sum(buffer, mesh.shard_group)
    dist.all_reduce(output, group=mesh.replicate_group)
    return output.div_(mesh.data_parallel_size), None


def _replicas_first(c, buffer, mesh, partial, all_reduce):
    c.all_reduce_mean(buffer, mesh.replicate_group)
    return c.reduce_scatter_mean(buffer, mesh.shard_group), None


def _no_all_reduce(c, buffer, mesh, partial, all_reduce):
    return c.average.__wrapped__(buffer, c.MeshInfo(mesh.shard_group), partial, all_reduce)


def _fp16_factors_of_the_shard_group(c, buffer, mesh, partial, all_reduce):
    import torch.distributed as dist

    output, _ = c.average.__wrapped__(buffer, c.MeshInfo(mesh.shard_group))
    dist.all_reduce(output, group=mesh.replicate_group)
    return output.div_(mesh.replicate_size), None


def _fp16_post_before_all_reduce(c, buffer, mesh, partial, all_reduce):
    import torch.distributed as dist

    pre, post = c.fp16_divide_factors(mesh.data_parallel_size)
    output = c.reduce_scatter_sum(buffer.div_(pre), mesh.shard_group).div_(post)
    dist.all_reduce(output, group=mesh.replicate_group)
    return output, None


def _all_reduce_each_micro_batch(c, buffer, mesh, partial, all_reduce):
    output, _ = c.average.__wrapped__(buffer, mesh)
    if not all_reduce:
        return None, output if partial is None else partial.add_(output)
    return (output if partial is None else output.add_(partial)), None


def _partial_replaced(c, buffer, mesh, partial, all_reduce):
    if not all_reduce:
        return c.average.__wrapped__(buffer, mesh, None, False)  # the kept rows dropped
    return c.average.__wrapped__(buffer, mesh, partial, all_reduce)


def hsdp_mesh_dims_swapped(module):
    """Lesson 18: a 2-D DeviceMesh read shard dim first: each rank shards with the ranks that
    should hold its rows, and replicates across the ones it should shard with."""
    def swapped(original):
        def mesh_info(mesh, device_type):
            if getattr(mesh, "ndim", None) != 2:
                return original(mesh, device_type)
            from miniddp.fsdp.mesh import MeshInfo

            return MeshInfo(mesh.get_group(0), mesh.get_group(1), mesh)
        return mesh_info
    breakages._patch(module, "mesh_info", swapped)


def _hsdp(dtypes, wrong, doc):
    def breakage(module):
        def patch(original):
            def average(buffer, mesh=module.EVERY_RANK, partial=None, all_reduce=True):
                if mesh.replicate_group is None or str(buffer.dtype)[6:] not in dtypes:
                    return original(buffer, mesh, partial, all_reduce)
                return wrong(module, buffer, mesh, partial, all_reduce)
            average.__wrapped__ = original
            return average
        breakages._patch(module, "average", patch)
    breakage.__doc__ = doc
    return breakage


HSDP = {
    "hsdp_one_division": _hsdp(("float32",), _one_division, """Lesson 18: both sums first,
        then one division by every rank's count, instead of / S after the reduce-scatter and
        / R after the all-reduce (equal while S is a power of two)."""),
    "hsdp_replicas_first": _hsdp(("float32",), _replicas_first, """Lesson 18: the groups in
        the other order: all-reduced across the replicas first, then reduce-scattered."""),
    "hsdp_no_all_reduce": _hsdp(("float32", "bfloat16", "float16"), _no_all_reduce, """Lesson
        18: no all-reduce across the replicas: each keeps its own shard group's average."""),
    "hsdp_fp16_factors_of_the_shard_group": _hsdp(
        ("float16",), _fp16_factors_of_the_shard_group, """Lesson 18: fp16's pre and post
        factors from the shard group's size, the replicas' count divided after the
        all-reduce (torch splits the count of every rank)."""),
    "hsdp_fp16_post_before_all_reduce": _hsdp(("float16",), _fp16_post_before_all_reduce,
                                              """Lesson 18: fp16 divided by post right after
        the reduce-scatter, before the all-reduce across the replicas."""),
    "hsdp_all_reduce_each_micro_batch": _hsdp(
        ("float32", "bfloat16", "float16"), _all_reduce_each_micro_batch, """Lesson 18:
        set_requires_all_reduce(False) ignored: each micro-batch all-reduced at once and the
        averages added up, instead of the rows added up and all-reduced once."""),
    "hsdp_partial_replaced": _hsdp(
        ("float32", "bfloat16", "float16"), _partial_replaced, """Lesson 18: a micro-batch
        without all-reduce replaces the rows kept from the one before instead of adding to
        them (seen from the third micro-batch on)."""),
}


#: name -> (module it patches, the patch)
SHARDING = {
    "zero_partition_by_count": ("miniddp.optim.zero", zero_partition_by_count),
    "zero_partition_in_model_order": ("miniddp.optim.zero", zero_partition_in_model_order),
    "zero_steps_every_parameter": ("miniddp.optim.zero", zero_steps_every_parameter),
    "zero_broadcasts_from_rank_0": ("miniddp.optim.zero", zero_broadcasts_from_rank_0),
    "zero_never_sends": ("miniddp.optim.zero", zero_never_sends),
    "fsdp_fp16_like_fp32": ("miniddp.fsdp.collectives", fsdp_fp16_like_fp32),
    "fsdp_fp16_factors_halved_once": ("miniddp.fsdp.collectives", fsdp_fp16_factors_halved_once),
    "fsdp_root_resharded": ("miniddp.fsdp.state", fsdp_root_resharded),
    "fsdp_never_frees_after_forward": ("miniddp.fsdp.state", fsdp_never_frees_after_forward),
    "fsdp_zero2_ignored": ("miniddp.fsdp.param_group", fsdp_zero2_ignored),
    "fsdp_no_gather_for_backward": ("miniddp.fsdp.param_group", fsdp_no_gather_for_backward),
    "fsdp_gradient_overwritten": ("miniddp.fsdp.param", fsdp_gradient_overwritten),
    "fsdp_sync_always": ("miniddp.fsdp.param_group", fsdp_sync_always),
    "fsdp_kept_in_compute_dtype": ("miniddp.fsdp.param_group", fsdp_kept_in_compute_dtype),
    "fsdp_reduce_dtype_ignored": ("miniddp.fsdp.param_group", fsdp_reduce_dtype_ignored),
    "fsdp_frozen_after_sharding_ignored": ("miniddp.fsdp.param",
                                           fsdp_frozen_after_sharding_ignored),
    "fsdp_full_state_dict_keeps_padding": ("miniddp.fsdp", fsdp_full_state_dict_keeps_padding),
    "fsdp_checkpoint_rows_as_plain_tensors": ("miniddp.fsdp.state_dict",
                                              fsdp_checkpoint_rows_as_plain_tensors),
    **{name: ("miniddp.fsdp.collectives", patch) for name, patch in HSDP.items()},
    "hsdp_mesh_dims_swapped": ("miniddp.fsdp.api", hsdp_mesh_dims_swapped),
}
