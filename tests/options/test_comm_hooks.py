"""Communication hooks: torch's hooks, and miniddp's own, give torch's DDP bits on miniddp.

Each case trains miniddp's DDP and torch's DDP side by side, each with its own copy of the same
hook (and of its state: PowerSGD keeps per-bucket memory), and compares every gradient and
parameter bit for bit (``checks.bits.bit_difference``) after every step, at 2 and 3 ranks (at 3,
gloo's ring sums an element in an order that depends on its offset in the bucket, so a wrong
layout or a wrong scaling shows in the bits).

On a CPU-only torch, torch's DDP refuses its own bf16 hooks by name (it wants CUDA and NCCL);
gloo can all_reduce bf16 all the same, so the CPU cases call them through a function of another
name on both sides. tests/engine/test_ddp_cuda.py runs them under their own names on a GPU.
"""

import contextlib
import copy

import ddp_cases as cases
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

import miniddp
from miniddp.options import comm_hooks
from miniddp.torch_versions import TORCH_RELEASE


def under_another_name(hook):
    """``hook`` behind a function torch's DDP does not recognise as one of its bf16 hooks."""
    def bucket_hook(state, bucket):
        return hook(state, bucket)
    return bucket_hook


def powersgd_state():
    """PowerSGD: plain all_reduce for 2 steps, then rank-1 compression. (torch 2.13's
    ``batched_powerSGD_hook`` fails its own assertion on any DDP, so it is not tested here.)"""
    return powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                  start_powerSGD_iter=2, random_seed=0)


def returns_the_works_future(state, bucket):
    """A hook whose future holds a list (what ``Work.get_future()`` gives), not a tensor."""
    bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future()


# name -> a function making a fresh (state, hook), called once for each of the two DDPs
HOOKS = {
    "allreduce_hook": lambda: (None, torch_hooks.allreduce_hook),
    "fp16_compress_hook": lambda: (None, torch_hooks.fp16_compress_hook),
    "bf16_compress_hook": lambda: (None, torch_hooks.bf16_compress_hook),
    "bf16_compress_hook_renamed": lambda: (None, under_another_name(
        torch_hooks.bf16_compress_hook)),
    "fp16_compress_wrapper": lambda: (None, torch_hooks.fp16_compress_wrapper(
        torch_hooks.allreduce_hook)),
    "bf16_compress_wrapper": lambda: (None, torch_hooks.bf16_compress_wrapper(
        torch_hooks.allreduce_hook)),
    "bf16_compress_wrapper_renamed": lambda: (None, under_another_name(
        torch_hooks.bf16_compress_wrapper(torch_hooks.allreduce_hook))),
    "noop_hook": lambda: (None, debugging_hooks.noop_hook),
    "powerSGD_hook": lambda: (powersgd_state(), powersgd.powerSGD_hook),
    "fp16_compress_wrapper_powerSGD": lambda: (powersgd_state(),
                                               torch_hooks.fp16_compress_wrapper(
                                                   powersgd.powerSGD_hook)),
}
# miniddp's own hooks, and the torch hook each must equal
OURS = {
    "miniddp_allreduce": (comm_hooks.allreduce, "allreduce_hook"),
    "miniddp_fp16_compress": (comm_hooks.fp16_compress, "fp16_compress_hook"),
    "miniddp_bf16_compress": (comm_hooks.bf16_compress, "bf16_compress_hook_renamed"),
    "future_holding_a_list": (returns_the_works_future, "allreduce_hook"),
}


def hooks_for(name):
    """(miniddp's state and hook, torch's state and hook) for a case name."""
    if name in OURS:
        ours, theirs = OURS[name]
        return (None, ours), HOOKS[theirs]()
    return HOOKS[name](), HOOKS[name]()


def compare_hook(hook, steps=4, micro_batches=1, model_name="mlp", register_at_step=0,
                 set_to_none=True, sabotage=None, device="cpu", **ddp_kwargs) -> dict:
    """Train miniddp's and torch's DDP side by side, each with ``hook``; return mismatches.

    ``register_at_step`` registers the hooks before that step's forward (0: before training).
    ``sabotage`` breaks miniddp on purpose, to show the comparison catches it:
    ``"scale_twice"`` scales gradients into the bucket as if no hook were set (the hook then
    divides again); ``"ignore_result"`` drops a future's value that is not the bucket itself.
    """
    rank = dist.get_rank()
    torch.manual_seed(1234 + rank)  # different on each rank: construction must broadcast
    module = (cases.MLP() if model_name == "mlp" else cases.MODELS[model_name]()).to(device)
    with cases.first_bucket_as_small_as(ddp_kwargs.get("bucket_cap_mb")):
        ours = miniddp.DistributedDataParallel(copy.deepcopy(module), **ddp_kwargs)
        theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(module), **ddp_kwargs)
    if sabotage == "scale_twice":
        scale = 1.0 / dist.get_world_size()
        ours.reducer._copy_into_bucket = (
            lambda param, view, _scale=True: torch.mul(param.grad, scale, out=view))
        ours.reducer.copy_buckets_at_end(-1)  # every gradient through the copy above
    (our_state, our_hook), (their_state, their_hook) = hooks_for(hook)
    both = [(ours, cases.make_optimizer("sgd", ours.parameters())),
            (theirs, cases.make_optimizer("sgd", theirs.parameters()))]
    problems, dtypes = [], []  # dtypes: (name, ours, torch's) where .grad dtypes differ
    for step in range(steps):
        if step == register_at_step:
            ours.register_comm_hook(our_state, our_hook)
            theirs.register_comm_hook(their_state, their_hook)
            if sabotage == "ignore_result":
                ours.reducer.comm_hook.finish = lambda bucket: None
        for _, opt in both:
            opt.zero_grad(set_to_none=set_to_none)
        for micro in range(micro_batches):
            args, kwargs, y = cases.to_device(cases.batch(model_name, step, micro, rank), device)
            for ddp, _ in both:
                synced = micro == micro_batches - 1
                with contextlib.nullcontext() if synced else ddp.no_sync():
                    cases.loss_of(model_name, ddp(*args, **kwargs), y).backward()
        if [b.param_indices for b in ours.buckets] != cases.torch_bucket_layout(theirs):
            problems.append(f"step {step}: bucket layout differs from torch's")
        for (name, a), b in zip(ours.module.named_parameters(), theirs.module.parameters()):
            if a.grad is not None and b.grad is not None and a.grad.dtype != b.grad.dtype:
                dtypes.append((name, a.grad.dtype, b.grad.dtype))  # values compared below
                cases._diff("grad", step, name, a.grad, b.grad.to(a.grad.dtype), problems)
            else:
                cases._diff("grad", step, name, a.grad, b.grad, problems)
        for _, opt in both:
            opt.step()
        for (name, a), b in zip(ours.module.named_parameters(), theirs.module.parameters()):
            cases._diff("param", step, name, a, b, problems)
    compressed = len(getattr(our_state, "p_memory_dict", {}))  # PowerSGD's low-rank factors
    return {"problems": problems[:10], "buckets": len(ours.buckets), "dtypes": dtypes,
            "powersgd_compressed": compressed > 0}


def check(results, case):
    for rank, result in enumerate(results):
        assert result["problems"] == [], f"{case}: rank {rank} differs from torch's DDP"
        assert result["dtypes"] == [], f"{case}: rank {rank} has .grad dtypes torch has not"


MANY_BUCKETS = {"bucket_cap_mb": 0.0001}  # the 16-32-32-4 MLP in 5 buckets after the rebuild
# PowerSGD's callbacks start a second all_reduce and wait for it on the thread that completed the
# first; with gloo and several buckets in flight the collectives interleave differently on each
# rank, and torch's DDP aborts ("Is there a distributed collective mismatch?"). One bucket works.
ONE_BUCKET_ON_GLOO = {"powerSGD_hook", "fp16_compress_wrapper_powerSGD"}
CPU_HOOKS = [h for h in list(HOOKS) + list(OURS)
             if h not in ("bf16_compress_hook", "bf16_compress_wrapper")]


def all_reduces_bf16() -> bool:
    """Whether this backend sums bf16 tensors (gloo learnt to around torch 2.2)."""
    try:
        dist.all_reduce(torch.ones(1, dtype=torch.bfloat16))
    except RuntimeError:  # "Invalid scalar type", raised on every rank before any message
        return False
    return True


def multiplies_fp16_batches() -> bool:
    """Whether the CPU has an fp16 ``bmm``, which PowerSGD's compression needs (not on 2.1)."""
    try:
        torch.bmm(torch.ones(1, 1, 1, dtype=torch.half), torch.ones(1, 1, 1, dtype=torch.half))
    except RuntimeError:  # "bmm" not implemented for 'Half'
        return False
    return True


def buckets_for(hook) -> dict:
    return {} if hook in ONE_BUCKET_ON_GLOO else MANY_BUCKETS


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("hook", CPU_HOOKS)
def test_hook_bit_identical_to_torch_ddp(ranks, world_size, hook):
    if "bf16" in hook and not ranks(world_size).run(all_reduces_bf16)[0]:
        pytest.skip(f"gloo cannot all_reduce bf16 on torch {torch.__version__}")
    if hook == "fp16_compress_wrapper_powerSGD" and not multiplies_fp16_batches():
        pytest.skip(f"torch {torch.__version__} has no fp16 bmm on the CPU, so its own "
                    "PowerSGD fails on fp16 buckets")
    results = ranks(world_size).run(compare_hook, hook, **buckets_for(hook))
    check(results, hook)
    expected = 1 if hook in ONE_BUCKET_ON_GLOO else 5
    assert results[0]["buckets"] == expected, "the case should have the buckets it says"
    if "powerSGD" in hook:
        assert results[0]["powersgd_compressed"], "PowerSGD never got past plain all_reduce"


VARIANTS = {
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "find_unused_parameters": {"model_name": "branchy", "find_unused_parameters": True,
                               "steps": 5},
    "no_sync": {"micro_batches": 3},
    "views_unused_no_sync": {"model_name": "branchy", "find_unused_parameters": True,
                             "gradient_as_bucket_view": True, "micro_batches": 3},
    "registered_after_the_first_backward": {"register_at_step": 2},
    "gradient_as_bucket_view_zeroed_in_place": {"gradient_as_bucket_view": True,
                                                "set_to_none": False},
    "conv_batchnorm": {"model_name": "conv_bn"},
    "tied_and_frozen": {"model_name": "tied_frozen"},
}
VARIANT_HOOKS = ["allreduce_hook", "fp16_compress_wrapper", "powerSGD_hook",
                 "miniddp_fp16_compress"]


# Where torch's DDP itself fails on gloo, or is wrong (then a test below checks miniddp alone).
TORCH_FAILS = {
    ("powerSGD_hook", "find_unused_parameters"): "torch's DDP aborts too: the used-parameter "
    "flags' all_reduce interleaves with PowerSGD's nested ones (see ONE_BUCKET_ON_GLOO)",
    ("powerSGD_hook", "views_unused_no_sync"): "as powerSGD_hook with find_unused_parameters",
    ("fp16_compress_wrapper", "find_unused_parameters"): "torch gives an fp16 .grad to an fp32 "
    "parameter unused here and used elsewhere; miniddp does not copy that "
    "(test_fp16_result_gives_the_parameters_dtype)",
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("hook", VARIANT_HOOKS)
def test_hook_with_ddp_options_bit_identical(ranks, world_size, variant, hook):
    if (hook, variant) in TORCH_FAILS:
        pytest.skip(TORCH_FAILS[hook, variant])
    results = ranks(world_size).run(compare_hook, hook, **VARIANTS[variant], **buckets_for(hook))
    check(results, f"{hook} {variant}")


def test_fp16_result_gives_the_parameters_dtype(ranks):
    """A hook whose future holds an fp16 tensor (``fp16_compress_wrapper``), and a parameter
    that got no gradient on this rank but did on another: torch's DDP creates its ``.grad``
    from the fp16 result, in fp16 (from then on the optimizer's momentum is fp16 too).
    miniddp gives it the parameter's dtype, with the same values."""
    results = ranks(2).run(compare_hook, "fp16_compress_wrapper", steps=1, model_name="branchy",
                           find_unused_parameters=True, **MANY_BUCKETS)
    assert all(r["problems"] == [] for r in results), "the values must still be torch's"
    rank_without_the_branch = results[1]  # branchy uses the branch on rank 0 only at step 0
    if TORCH_RELEASE <= (2, 4):  # 2.1.2, 2.3.1, 2.4.1 give the parameter's dtype too (not 2.11)
        assert rank_without_the_branch["dtypes"] == []
        return
    assert rank_without_the_branch["dtypes"], "torch fixed it? then compare dtypes too"
    assert all(ours == torch.float32 for _, ours, _ in rank_without_the_branch["dtypes"])


@pytest.mark.parametrize("hook, sabotage", [("allreduce_hook", "scale_twice"),
                                            ("fp16_compress_wrapper", "ignore_result")])
def test_comparison_catches_a_wrong_hook_path(ranks, hook, sabotage):
    """Negative controls: miniddp broken on purpose must differ from torch's DDP."""
    results = ranks(3).run(compare_hook, hook, sabotage=sabotage, **MANY_BUCKETS)
    assert all(r["problems"] for r in results), f"sabotage {sabotage!r} went unnoticed"


# ----- what a hook sees, and what registration refuses -----

def buckets_seen(ddp_class, steps=2):
    """What a hook is given, step by step: index, is_last, parameters, buffer, gradients."""
    torch.manual_seed(0)
    with cases.first_bucket_as_small_as(MANY_BUCKETS["bucket_cap_mb"]):  # torch < 2.4 too
        ddp = ddp_class(cases.MLP(), **MANY_BUCKETS)
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    seen = []

    def recording_hook(state, bucket):
        params = bucket.parameters()
        grads = [p.grad for p in params]
        seen.append({
            "index": bucket.index(), "is_last": bucket.is_last(),
            "parameters": [names[id(p)] for p in params],
            "buffer_is_unscaled": torch.equal(bucket.buffer(),
                                              torch.cat([g.flatten() for g in grads])),
            "gradients": [(tuple(v.shape), torch.equal(v, g))
                          for v, g in zip(bucket.gradients(), grads)],
            "gradients_are_views": all(v.data_ptr() >= bucket.buffer().data_ptr()
                                       and v._base is not None for v in bucket.gradients()),
        })
        return torch_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, recording_hook)
    for step in range(steps):
        (x,), _, _ = cases.batch("mlp", step, 0, dist.get_rank())
        ddp(x).sum().backward()
    return seen


def buckets_seen_by_both():
    return (buckets_seen(miniddp.DistributedDataParallel),
            buckets_seen(nn.parallel.DistributedDataParallel))


def test_hook_sees_the_bucket_torch_gives(ranks):
    ours, theirs = ranks(2).run(buckets_seen_by_both)[0]
    assert ours == theirs
    assert [b["index"] for b in ours] == [0, 0, 1, 2, 3, 4], "one bucket, then five"
    assert all(b["buffer_is_unscaled"] and b["gradients_are_views"] for b in ours)


def refusals(ddp_class):
    """The exception (type, message) each questionable registration raises, or None."""
    def attempt(*hooks):
        ddp = ddp_class(nn.Linear(4, 2))
        try:
            for hook in hooks:
                ddp.register_comm_hook(None, hook)
        except Exception as error:  # noqa: BLE001 - what is raised is what we compare
            return type(error).__name__, str(error)
        return None

    def annotated_bucket(state, bucket: int):
        pass

    def annotated_return(state, bucket) -> int:
        pass

    def well_annotated(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        pass

    return {
        "twice": attempt(torch_hooks.allreduce_hook, torch_hooks.allreduce_hook),
        "not_callable": attempt(3),
        "bucket_annotation": attempt(annotated_bucket),
        "return_annotation": attempt(annotated_return),
        "well_annotated": attempt(well_annotated),
        "bf16_compress_hook": attempt(torch_hooks.bf16_compress_hook),
        "bf16_compress_wrapper": attempt(torch_hooks.bf16_compress_wrapper(
            torch_hooks.allreduce_hook)),
    }


def refusals_of_both():
    return (refusals(miniddp.DistributedDataParallel),
            refusals(nn.parallel.DistributedDataParallel))


def test_registration_refuses_what_torch_refuses(ranks):
    ours, theirs = ranks(2).run(refusals_of_both)[0]
    for case, torch_says in theirs.items():
        if torch_says is None:
            assert ours[case] is None, f"{case}: torch accepts it, miniddp raised {ours[case]}"
        else:
            assert ours[case] is not None, f"{case}: torch raises {torch_says}, miniddp accepts"
            assert ours[case][0] == torch_says[0], case
            assert ours[case][1].startswith(torch_says[1].split(".")[0]), case
    assert ours["twice"] is not None and ours["well_annotated"] is None
    assert "allreduce_hook" in ours["twice"][1], "the message should name the hook in place"


def misbehaving_hooks():
    """What backward raises when a hook returns something unusable (one fresh DDP each)."""
    def returns_an_int(state, bucket):
        return 5

    def returns_the_wrong_size(state, bucket):
        done = torch.futures.Future()
        done.set_result(torch.zeros(3))
        return done

    errors = {}
    for name, hook in [("int", returns_an_int), ("size", returns_the_wrong_size)]:
        ddp = miniddp.DistributedDataParallel(nn.Linear(4, 2))
        ddp.register_comm_hook(None, hook)
        try:
            ddp(torch.randn(3, 4)).sum().backward()
        except RuntimeError as error:
            errors[name] = str(error)
    return errors


def test_unusable_hook_results_raise_clear_errors(ranks):
    errors = ranks(2).run(misbehaving_hooks)[0]
    assert "returned int, not a torch.futures.Future" in errors["int"]
    assert "returns_an_int" in errors["int"]
    assert "a tensor of 3 elements" in errors["size"] and "(10 elements)" in errors["size"]


def failing_hook_futures():
    """What backward raises, under either DDP, when a hook's future fails: at once (the hook
    set an exception) or in a callback chained after the all_reduce."""
    def fails_at_once(state, bucket):
        failed = torch.futures.Future()
        failed.set_exception(ValueError("boom from the hook"))
        return failed

    def fails_in_a_callback(state, bucket):
        def callback(future):
            raise KeyError("boom from its callback")
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(callback)

    raised = {}
    for wrap in (miniddp.DistributedDataParallel, nn.parallel.DistributedDataParallel):
        for hook in (fails_at_once, fails_in_a_callback):
            ddp = wrap(nn.Linear(4, 2))
            ddp.register_comm_hook(None, hook)
            try:
                ddp(torch.randn(3, 4)).sum().backward()
                raised[wrap.__module__, hook.__name__] = None
            except Exception as error:  # noqa: BLE001 (what it is, is the question)
                raised[wrap.__module__, hook.__name__] = (type(error), str(error))
    return raised


def test_a_failing_hook_future_is_a_runtime_error_as_in_torch(ranks):
    raised = ranks(2).run(failing_hook_futures)[0]
    for hook, boom in (("fails_at_once", "boom from the hook"),
                       ("fails_in_a_callback", "boom from its callback")):
        ours, theirs = raised["miniddp.ddp", hook], raised[nn.parallel.distributed.__name__, hook]
        assert theirs is not None and theirs[0] is RuntimeError and boom in theirs[1], theirs
        assert ours is not None and ours[0] is RuntimeError and boom in ours[1], f"{hook}: {ours}"
    # torch's futures already wrap a callback's error in a RuntimeError; the other is named
    assert "fails_at_once" in raised["miniddp.ddp", "fails_at_once"][1]


def test_a_missing_bucket_argument_is_named():
    with pytest.raises(TypeError, match=r"named \(state, bucket\)"):
        comm_hooks.check_hook(lambda state, b: None)


def test_gradbucket_views_follow_set_buffer():
    params = [torch.zeros(2, 3), torch.zeros(4)]
    bucket = comm_hooks.GradBucket(1, 2, torch.arange(10.0), params)
    assert bucket.is_last() and bucket.index() == 1
    half = torch.arange(10.0).half()
    bucket.set_buffer(half)
    first, second = bucket.gradients()
    assert first.dtype == torch.float16 and first.shape == (2, 3)
    assert torch.equal(second, torch.arange(6.0, 10.0).half())
    assert second.data_ptr() == half[6:].data_ptr()


def builtin_hook_by_name():
    found = {}
    for kind, cls in (("miniddp", miniddp.DistributedDataParallel),
                      ("torch", nn.parallel.DistributedDataParallel)):
        try:
            cls(nn.Linear(2, 2))._register_builtin_comm_hook("ALLREDUCE")
            found[kind] = None
        except Exception as error:  # noqa: BLE001 (the type is what is compared)
            found[kind] = type(error).__name__
    return found


def test_a_builtin_hook_given_by_name_is_a_type_error_as_in_torch(ranks):
    assert ranks(2).run(builtin_hook_by_name)[0] == {"miniddp": "TypeError", "torch": "TypeError"}
