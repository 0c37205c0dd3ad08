"""DataParallel, the single-process baseline: scatter, replicate, run in threads, gather.

The oracle is the plain module run on the whole batch: outputs, input gradients, parameter
gradients and optimizer steps through DataParallel must match it. On this CPU-only machine the
replicas are ``"cpu"`` threads; the CUDA test runs where a GPU is present.
"""

import copy
import threading
import warnings

import pytest
import torch
from torch import nn

from miniddp.baselines.data_parallel import DataParallel

TIGHT = dict(rtol=1e-10, atol=1e-12)  # float64: only summation order may differ


def mlp():
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


def conv_net():
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2),
        nn.Flatten(), nn.Linear(4 * 3 * 3, 3),
    )


MODELS = {"mlp": (mlp, (5,)), "conv": (conv_net, (2, 7, 7))}


def pair(make, seed=0):
    """The same float64 model twice: one to wrap, one to run plainly on the whole batch."""
    torch.manual_seed(seed)
    model = make().double()
    return model, copy.deepcopy(model)


def cpus(n):
    return ["cpu"] * n


def assert_grads_match(ours, plain):
    for (name, p), q in zip(ours.named_parameters(), plain.parameters(), strict=True):
        assert p.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(p.grad, q.grad, **TIGHT, msg=f"gradient of {name}")


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("batch", [6, 7, 2], ids=["even", "uneven", "smaller_than_replicas"])
def test_outputs_and_gradients_match_the_plain_module(model_name, replicas, batch):
    make, shape = MODELS[model_name]
    model, plain = pair(make)
    dp = DataParallel(model, device_ids=cpus(replicas))
    x = torch.randn(batch, *shape, dtype=torch.float64, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    weights = torch.randn(batch, 3, dtype=torch.float64)

    out = dp(x)
    expected = plain(x_plain)
    torch.testing.assert_close(out, expected, **TIGHT)
    (out * weights).sum().backward()
    (expected * weights).sum().backward()

    torch.testing.assert_close(x.grad, x_plain.grad, **TIGHT)
    assert_grads_match(model, plain)
    assert dp.last_forward.replicas == len(torch.arange(batch).chunk(replicas))


def test_an_optimizer_step_through_dataparallel_trains_the_original_module():
    model, plain = pair(mlp)
    dp = DataParallel(model, device_ids=cpus(3))
    opt = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
        for net, opt_ in ((dp, opt), (plain, opt_plain)):
            opt_.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt_.step()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, **TIGHT)
    assert not torch.equal(model[0].weight, pair(mlp)[0][0].weight), "training changed nothing"


class Recorder(nn.Module):
    """Records which thread ran it and how big a chunk it saw."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.seen = []

    def forward(self, x):
        self.seen.append((threading.current_thread().name, x.shape[0]))
        return self.linear(x)


def test_each_replica_runs_in_its_own_thread_on_a_torch_chunk_sized_slice():
    model = Recorder()
    dp = DataParallel(model, device_ids=cpus(3))
    dp(torch.randn(7, 4))
    names = {name for name, _ in model.seen}
    assert len(names) == 3 and threading.current_thread().name not in names
    assert sorted(size for _, size in model.seen) == [1, 3, 3]  # torch.chunk: 3, 3, 1


def test_the_counters_show_the_weights_copied_every_forward():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    dp = DataParallel(model, device_ids=cpus(3))
    for batch, replicas in ((9, 3), (4, 2)):
        dp(torch.randn(batch, 4))
        stats = dp.last_forward
        assert stats.replicas == replicas
        assert stats.param_bytes_copied == (replicas - 1) * param_bytes  # replica 0 copies none
        assert stats.buffer_bytes_copied == (replicas - 1) * buffer_bytes


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.encode = nn.Linear(4, 4, bias=False)
        self.decode = nn.Linear(4, 4, bias=False)
        self.decode.weight = self.encode.weight

    def forward(self, x):
        return self.decode(torch.tanh(self.encode(x)))


def test_tied_weights_are_copied_once_per_replica_and_stay_tied():
    model, plain = pair(Tied)
    dp = DataParallel(model, device_ids=cpus(2))
    x = torch.randn(6, 4, dtype=torch.float64)
    dp(x).square().sum().backward()
    plain(x).square().sum().backward()
    assert_grads_match(model, plain)
    assert dp.last_forward.param_bytes_copied == 4 * 4 * 8


def test_an_lstm_replicates_through_its_own_hook():
    """An RNN caches a list of its weights: replicas must not write their copies into it."""
    model, plain = pair(lambda: nn.LSTM(3, 5, batch_first=True))
    dp = DataParallel(model, device_ids=cpus(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.5)
    x = torch.randn(4, 4, 3, dtype=torch.float64)  # 4 sequences: 2 per replica
    for _ in range(2):
        out, (h, _) = dp(x)
        expected, _ = plain(x)
        torch.testing.assert_close(out, expected, **TIGHT)
        assert h.shape == (2, 2, 5)  # h is (layers, batch, hidden): dim 0 is not its batch dim
        out.sum().backward()
        expected.sum().backward()
        assert_grads_match(model, plain)
        for optimizer in (opt, opt_plain):
            optimizer.step()
            optimizer.zero_grad()
    torch.testing.assert_close(model(x)[0], plain(x)[0], **TIGHT)


class ManyArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x, pair, *, scale, mode="add", extras=None):
        a, b = pair
        y = self.linear(x) * scale
        y = y + a if mode == "add" else y - a
        return y, {"b_twice": 2 * b["b"], "none": None, "chunk": torch.tensor([x.shape[0]])}


@pytest.mark.parametrize("replicas", [1, 3])
def test_several_inputs_kwargs_non_tensor_args_and_structured_outputs(replicas):
    model, plain = pair(ManyArgs)
    dp = DataParallel(model, device_ids=cpus(replicas))
    x, a, b = (torch.randn(7, 3, dtype=torch.float64) for _ in range(3))
    kwargs = dict(scale=torch.full((7, 1), 0.5, dtype=torch.float64), mode="sub", extras=[1, 2])
    y, rest = dp(x, (a, {"b": b}), **kwargs)
    y_plain, rest_plain = plain(x, (a, {"b": b}), **kwargs)
    torch.testing.assert_close(y, y_plain, **TIGHT)
    torch.testing.assert_close(rest["b_twice"], rest_plain["b_twice"], **TIGHT)
    assert rest["none"] is None
    assert rest["chunk"].tolist() == [c.shape[0] for c in x.chunk(replicas)]


def test_dim_1_splits_and_gathers_along_the_second_dimension():
    class FeaturesFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 6, dtype=torch.float64))

        def forward(self, x):  # x: (features, batch)
            return torch.tanh(self.weight @ x)

    model, plain = pair(FeaturesFirst)
    dp = DataParallel(model, device_ids=cpus(3), dim=1)
    x = torch.randn(6, 8, dtype=torch.float64)
    out = dp(x)
    torch.testing.assert_close(out, plain(x), **TIGHT)
    out.sum().backward()
    plain(x).sum().backward()
    assert_grads_match(model, plain)


class GradModeRecorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(5, 3)
        self.grad_modes = []

    def forward(self, x):
        self.grad_modes.append(torch.is_grad_enabled())
        return self.linear(x)


def test_grad_mode_and_autocast_reach_the_worker_threads():
    model = GradModeRecorder()
    dp = DataParallel(model, device_ids=cpus(2))
    x = torch.randn(6, 5)
    with torch.no_grad():
        dp(x)
    assert model.grad_modes == [False, False]  # new threads start with grad on
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dp(x).dtype == torch.bfloat16
    out = dp(x)
    assert out.dtype == torch.float32 and out.requires_grad


def test_only_replica_0_buffer_updates_survive():
    model = nn.BatchNorm1d(3)
    reference = nn.BatchNorm1d(3)
    x = torch.randn(8, 3)
    DataParallel(model, device_ids=cpus(2))(x)
    reference(x[:4])  # what replica 0 saw
    torch.testing.assert_close(model.running_mean, reference.running_mean)
    torch.testing.assert_close(model.running_var, reference.running_var)
    assert model.num_batches_tracked.item() == 1


def test_state_dict_keys_carry_the_module_prefix():
    model = mlp()
    dp = DataParallel(model, device_ids=cpus(2))
    assert dp.module is model
    assert list(dp.state_dict()) == [f"module.{k}" for k in model.state_dict()]


class SumLoss(nn.Module):
    def forward(self, x):
        return x.sum()


def test_scalar_outputs_become_one_value_per_replica():
    with pytest.warns(UserWarning, match="one per replica"):
        assert DataParallel(SumLoss(), device_ids=cpus(3))(torch.randn(7, 2)).shape == (3,)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert DataParallel(SumLoss(), device_ids=cpus(1))(torch.randn(7, 2)).shape == ()


def test_an_empty_device_list_says_what_to_pass():
    with pytest.raises(ValueError, match=r"empty device_ids.*\[0, 1\].*'cpu'"):
        DataParallel(mlp(), device_ids=[])


@pytest.mark.parametrize("bad", ["gpu0", "tpu", 3.5, "meta"])
def test_an_unknown_device_is_refused(bad):
    with pytest.raises(ValueError, match="does not know the device|on 'cpu' or CUDA devices"):
        DataParallel(mlp(), device_ids=[bad])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a CPU-only machine")
def test_asking_for_a_gpu_without_one_suggests_cpu_replicas():
    with pytest.raises(ValueError, match=r"0 visible GPU.*device_ids=\['cpu', 'cpu'\]"):
        DataParallel(mlp(), device_ids=[0, 1])
    assert DataParallel(mlp()).device_ids == [torch.device("cpu")]


def test_a_module_off_the_first_device_is_refused():
    dp = DataParallel(mlp().to("meta"), device_ids=cpus(2))
    with pytest.raises(RuntimeError, match=r"on the first device \(cpu\).*one is on meta"):
        dp(torch.randn(4, 5))


def test_tensors_of_different_batch_sizes_are_refused():
    dp = DataParallel(ManyArgs(), device_ids=cpus(2))
    with pytest.raises(ValueError, match=r"same size.*\(7, 3\).*\(2, 3\)"):
        dp(torch.randn(7, 3), (torch.randn(2, 3), {"b": torch.randn(7, 3)}), scale=1.0)


class FailsOnSmallChunks(nn.Module):
    def forward(self, x):
        if x.shape[0] < 3:
            raise KeyError("chunk too small")
        return x


def test_an_exception_in_a_replica_is_reraised_naming_it():
    dp = DataParallel(FailsOnSmallChunks(), device_ids=cpus(3))
    with pytest.raises(KeyError, match=r"in replica 2 of 3 \(device cpu\)") as info:
        dp(torch.randn(7, 2))  # chunks of 3, 3 and 1: the third replica fails
    assert isinstance(info.value.__cause__, KeyError)
    assert "chunk too small" in str(info.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_replicas_match_the_plain_module():
    n_gpus = torch.cuda.device_count()
    ids = list(range(n_gpus)) if n_gpus > 1 else [0, 0]  # one GPU: two replicas share it
    model, plain = pair(conv_net)
    model.cuda()
    dp = DataParallel(model, device_ids=ids, output_device="cpu")
    x = torch.randn(9, 2, 7, 7, dtype=torch.float64)
    out = dp(x.cuda())
    assert out.device == torch.device("cpu")
    torch.testing.assert_close(out, plain(x), rtol=1e-7, atol=1e-9)
    out.square().sum().backward()
    plain(x).square().sum().backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert p.grad.device == p.device
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-7, atol=1e-9)
    with torch.autocast("cuda", dtype=torch.float16):
        assert DataParallel(model.float(), device_ids=ids)(x.float().cuda()).dtype == torch.float16


class Returns(nn.Module):
    """Returns what torch's DataParallel would never gather: a tensor and a number, a dict with
    a string; takes a 0-dim tensor and a mask of another batch size; raises on request."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x, scale, mask=None, fail=False):
        if fail:
            raise IndexError("asked to fail")
        y = self.lin(x) * scale
        return (y, 5), {"y": y, "name": "hi", "masked": None if mask is None else mask.sum()}


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch's DataParallel on a CPU-only machine")
def test_one_replica_calls_the_module_itself_as_torchs_does():
    """torch's DataParallel without GPUs (and with one) calls the module: no split, no gather,
    no thread; so ours with one device must too."""
    torch.manual_seed(0)
    ours, theirs = DataParallel(Returns()), nn.DataParallel(Returns())
    theirs.load_state_dict(ours.state_dict())
    x, mask = torch.randn(6, 4), torch.ones(3)
    a, b = ours(x, torch.tensor(2.0), mask=mask), theirs(x, torch.tensor(2.0), mask=mask)
    assert a[0][1] == b[0][1] == 5 and a[1]["name"] == b[1]["name"] == "hi"
    assert torch.equal(a[0][0], b[0][0]) and torch.equal(a[1]["masked"], b[1]["masked"])
    assert ours.last_forward.replicas == 1
    for dp in (ours, theirs):  # the module's own exception, unchanged
        with pytest.raises(IndexError, match="^asked to fail$"):
            dp(x, 1.0, fail=True)
    packed = []  # thread-local state (here a saved-tensors hook) reaches the module
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        ours(x.requires_grad_(), 2.0)
    assert packed
