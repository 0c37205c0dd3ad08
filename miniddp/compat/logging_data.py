"""``ddp._get_ddp_logging_data()``: torch's record of a DDP run, with torch's keys.

torch documents this dictionary as the way to inspect a DDP job (its constructor arguments, the
bucket layout, errors, and how long forward, backward and communication took), and its own tests
read it. miniddp fills the same keys with the same meanings, so scripts and tests that read them
work unchanged:

* at construction: ``world_size``, ``rank``, ``module_name``, ``device_ids``, ``output_device``,
  ``broadcast_buffers``, ``bucket_cap_bytes``, ``find_unused_parameters``,
  ``gradient_as_bucket_view``, ``backend_name``, ``dtypes`` (torch's C++ names, e.g.
  ``"float"``), ``num_parameter_tensors``, ``total_parameter_size_bytes``, ``bucket_sizes``
  (iteration 0's buckets, in bytes) and the environment variables torch reports; ``static_graph``
  once it is set;
* ``comm_hook``: the registered communication hook's ``__qualname__`` (or the built-in type);
* ``has_error`` / ``error``: the last error DDP raised (``miniddp.errors.logged``);
* runtime statistics, in nanoseconds, as torch samples them: the first ten synchronized
  iterations, then one in every ``sample_rate`` (``_set_ddp_runtime_logging_sample_rate``,
  default 100; the reducer applies torch's rule and emits a ``sampled`` record at the start of
  each such iteration). At the start of the next synchronized forward the sampled iteration's
  times are taken, and ``iteration`` becomes its number. The times are host clock readings at
  five points of a step: forward start, the end of forward
  (backward compute start), the first bucket launched (comm start), every gradient ready
  (compute end) and every bucket waited for (comm end); ``backward_compute_comm_overlap_time`` is
  how long communication ran while gradients were still being computed. ``avg_*`` are running
  means over the sampled iterations. Also ``unused_parameter_size`` (bytes of parameters unused
  on this rank), ``prev_iteration_grad_ready_order_indices`` and, once the buckets have been
  rebuilt, ``has_rebuilt_buckets``, ``rebuilt_bucket_sizes`` and
  ``rebuilt_per_bucket_param_indices``.

The reducer pays nothing on iterations that are not sampled: nothing of this module listens to
their events.
"""

from __future__ import annotations

import functools
import os
import time

import torch
import torch.distributed as dist

from miniddp.options.comm_hooks import CommHook

#: The names torch's C++ logger gives dtypes (caffe2's TypeMeta names).
_DTYPE_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
                torch.bfloat16: "c10::BFloat16", torch.int64: "long int", torch.int32: "int"}

_ENV = {"master_port": "MASTER_PORT", "master_addr": "MASTER_ADDR",
        "torch_distributed_debug": "TORCH_DISTRIBUTED_DEBUG",
        "cuda_visible_devices": "CUDA_VISIBLE_DEVICES"}
_GLOO_ENV = {"gloo_socket_ifname": "GLOO_SOCKET_IFNAME",
             "gloo_device_transport": "GLOO_DEVICE_TRANSPORT"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


#: The reducer's events a sampled iteration records (``miniddp.reducer.EVENTS``).
TIMED_EVENTS = ("forward_end", "ready", "launch", "backward_end", "finalized")

#: Sampled iterations whose records wait to be turned into statistics: they are turned when the
#: data is read, or when this many are waiting (so a long run keeps a few records, not all).
MAX_WAITING = 10


class DDPLogging:
    """What ``ddp.logger`` holds: the dictionary ``_get_ddp_logging_data()`` returns.

    It listens to the reducer's ``error`` and ``sampled`` events. While iterations are sampled
    it also listens to the events it times, with one list's own ``append`` (so a sampled step
    runs little of this module), and to each forward, where a sampled iteration's records are
    kept for later: they become statistics when the data is read."""

    def __init__(self, ddp):
        self.data: dict[str, object] = {}
        self.sampled = 0  # iterations whose statistics were taken
        self.recording = 0  # the sampled iteration being recorded (0: none)
        self.records: list[tuple] = []  # its events (one list, subscribed while sampling)
        self.waiting: list[tuple] = []  # (iteration, records, unused bytes, rebuilt) to take
        #: The host clock (ns) minus the reducer's clock (``time.perf_counter``, in ns).
        self.clock_offset = time.time_ns() - int(time.perf_counter() * 1e9)
        self._construction(ddp)
        reducer = ddp.reducer
        reducer.subscribe(functools.partial(self.at_error, reducer), ("error",))
        reducer.subscribe(functools.partial(self.at_sampled, reducer), ("sampled",))
        self._at_forward = functools.partial(self.at_forward, reducer)

    def _construction(self, ddp) -> None:
        group = ddp.process_group
        params = ddp.reducer.params
        data = self.data
        data.update(
            world_size=dist.get_world_size(group), rank=dist.get_rank(group),
            module_name=type(ddp.module).__name__,
            device_ids=", ".join(map(str, ddp.device_ids or [])),
            output_device=-1 if ddp.output_device is None else ddp.output_device,
            broadcast_buffers=int(ddp.forward_sync_buffers), bucket_cap_bytes=ddp.bucket_bytes_cap,
            find_unused_parameters=int(ddp.find_unused_parameters),
            gradient_as_bucket_view=int(ddp.gradient_as_bucket_view),
            has_sync_bn=int(any(isinstance(m, torch.nn.SyncBatchNorm)
                                for m in ddp.module.modules())),
            is_multi_device_module=int(len({p.device for p in params}) > 1),
            backend_name=str(dist.get_backend(group)),
            dtypes=", ".join(sorted({dtype_name(p.dtype) for p in params})),
            num_parameter_tensors=len(params),
            total_parameter_size_bytes=sum(p.numel() * p.element_size() for p in params),
            bucket_sizes=_bucket_sizes(ddp.reducer), iteration=0)
        for key, var in _ENV.items():
            data[key] = os.environ.get(var, "N/A")
        if data["backend_name"] == "gloo":
            for key, var in _GLOO_ENV.items():
                data[key] = os.environ.get(var, "N/A")
            data["gloo_num_threads"] = _gloo_threads(group)

    # ----- what DDP reports -----

    def set_error(self, error: BaseException) -> None:
        self.data["has_error"] = 1
        self.data["error"] = str(error)

    def set_static_graph(self) -> None:
        self.data["static_graph"] = 1

    def set_sample_rate(self, sample_rate: int, reducer) -> None:
        if sample_rate < 1:
            raise ValueError("DDP runtime logging sample rate should be equal or greater than 1")
        reducer.sample_rate = sample_rate

    def at_sampled(self, reducer, record: tuple) -> None:
        """A sampled iteration begins: keep the last one's records if it was sampled too, or
        start listening (to the events it times, and to forwards, where a run of sampled
        iterations ends)."""
        if self.recording:
            self._keep(reducer)
        else:
            reducer.subscribe(self.records.append, TIMED_EVENTS)
            reducer.subscribe(self._at_forward, ("forward",))
        self.recording = record[1]
        self.records.append(("forward_start", -1, record[2]))

    def at_forward(self, reducer, _record: tuple) -> None:
        """A forward while listening: if it begins an iteration that is not sampled, the
        sampled ones are over."""
        if reducer.iterations != self.recording:
            self._keep(reducer)
            reducer.unsubscribe(self.records.append)
            reducer.unsubscribe(self._at_forward)
            self.recording = 0

    def _keep(self, reducer) -> None:
        """The recorded iteration's events, kept to become statistics."""
        unused = getattr(reducer.unused or reducer.static_graph, "unreached_this_step", ())
        self.waiting.append((self.recording, self.records[:], unused, reducer.has_rebuilt))
        self.records.clear()
        if len(self.waiting) >= MAX_WAITING:
            self._take_stats(reducer)

    def at_error(self, reducer, _record: tuple) -> None:
        self.set_error(reducer.error)

    def _take_stats(self, reducer) -> None:
        """The waiting iterations' records into torch's statistics, oldest first."""
        for iteration, records, unused, rebuilt in self.waiting:
            self._take_iteration(reducer, iteration, records, unused, rebuilt)
        self.waiting = []

    def _take_iteration(self, reducer, iteration: int, records: list[tuple], unused,
                        rebuilt: bool) -> None:
        data = self.data
        self.sampled += 1
        data["iteration"] = iteration
        data["unused_parameter_size"] = sum(reducer.params[i].numel()
                                            * reducer.params[i].element_size() for i in unused)
        if rebuilt:
            data["has_rebuilt_buckets"] = 1
            data["rebuilt_bucket_sizes"] = _bucket_sizes(reducer)
            data["rebuilt_per_bucket_param_indices"] = ", ".join(
                " ".join(map(str, b.param_indices)) for b in reducer.buckets)
        else:
            data.setdefault("has_rebuilt_buckets", 0)
        ready = [ident for event, ident, _ in records if event == "ready"]
        data["prev_iteration_grad_ready_order_indices"] = ", ".join(map(str, ready))
        data["num_buckets_reduced"] = sum(event == "launch" for event, _, _ in records)
        times = {}
        for event, _, when in records:  # the first time of each, in ns
            times.setdefault(_TIMES.get(event), int(when * 1e9) + self.clock_offset)
        times.pop(None, None)
        needed = ("forward_compute_time_start", "backward_compute_time_start",
                  "backward_compute_time_end", "backward_comm_time_start",
                  "backward_comm_time_end")
        if not all(k in times for k in needed):
            return  # a step without a full backward (e.g. an error): nothing to average
        data.update((k, times[k]) for k in needed)
        spans = {
            "forward_compute_time": times["backward_compute_time_start"]
            - times["forward_compute_time_start"],
            "backward_compute_time": times["backward_compute_time_end"]
            - times["backward_compute_time_start"],
            "backward_comm_time": times["backward_comm_time_end"]
            - times["backward_comm_time_start"],
            "backward_compute_comm_overlap_time": times["backward_compute_time_end"]
            - times["backward_comm_time_start"],
        }
        for key, span in spans.items():
            data[key] = span
            average = data.get("avg_" + key, 0)
            data["avg_" + key] = (average * (self.sampled - 1) + span) // self.sampled

    def snapshot(self, ddp) -> dict:
        self._take_stats(ddp.reducer)
        data = dict(self.data)
        hook = ddp.reducer.comm_hook
        if isinstance(hook, CommHook):
            data["comm_hook"] = hook.name
        return data


#: Which of torch's times each event gives (its first occurrence in the iteration).
_TIMES = {"forward_start": "forward_compute_time_start",
          "forward_end": "backward_compute_time_start",
          "launch": "backward_comm_time_start", "backward_end": "backward_compute_time_end",
          "finalized": "backward_comm_time_end"}


def _gloo_threads(group) -> int:
    """The gloo backend's thread count (torch reads the same option; 2 unless changed)."""
    group = group if group is not None else dist.group.WORLD
    try:
        return int(group._get_backend(torch.device("cpu")).options._threads)
    except (AttributeError, RuntimeError):  # an older torch, or no such option
        return 2


def _bucket_sizes(reducer) -> str:
    return ", ".join(str(b.buffer.numel() * b.buffer.element_size()) for b in reducer.buckets)
