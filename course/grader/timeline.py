"""Diagnosis by first divergence: the learner's run and torch's, each recorded on every rank as a
timeline of events, compared in order; a verdict's first line names the first event where they
differ.

An event is one thing that happened at one place of a run (``at``: "fp32 reduction, unit 2"):
a collective (its form, the ranks of its group), what it was handed (its dtype, its elements and
their bits), a result. Both sides are recorded the same way: torch's by the
same stand-in for torch.distributed (``Recorder``) around torch's own run, the learner's around
the learner's code. No list of known mistakes is needed to locate one: the first event whose
facts or bits differ is where the learner's run leaves torch's. A known mistake's name and
advice come after that line, and only when they speak of the same event.

    mine = collective_events(my_calls) + value_events("shard of", my_shards)
    theirs = collective_events(torch_calls) + value_events("shard of", torch_shards)
    said = first_divergence(mine, theirs)   # None when they agree
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

#: Names of one collective: torch's releases call it either way, and the learner may use any
SAME_COLLECTIVE = {"reduce_scatter_tensor": "reduce_scatter_single",
                   "_reduce_scatter_base": "reduce_scatter_single",
                   "all_gather_into_tensor": "all_gather_single",
                   "_all_gather_base": "all_gather_single"}
FORMS = {"reduce_scatter": "dist.reduce_scatter (the list form)",
         "all_gather": "dist.all_gather (the list form)"}


def argument(args, kwargs, position: int, *names):
    """A call's argument, given by one of ``names`` or at ``position``; None if absent."""
    for name in names:
        if name in kwargs:
            return kwargs[name]
    return args[position] if len(args) > position else None


def flat(t):
    if torch.is_tensor(t):
        return t.detach().clone().reshape(-1)
    if isinstance(t, (list, tuple)) and t and all(torch.is_tensor(x) for x in t):
        return torch.cat([x.detach().reshape(-1) for x in t])
    return None


def ranks_of(group) -> tuple[int, ...]:
    return tuple(range(dist.get_world_size()) if group is None
                 else dist.get_process_group_ranks(group))


class Recorder:
    """Stands in for some of torch.distributed's collectives while open, on either side: each
    call is recorded (its name, group ranks, reduce op, what it was handed, after the call what
    it gave) before it is made. With ``module``, the names that module bound to a collective
    (``all_gather = dist.all_gather_into_tensor``) are stood in for too. Subclasses change what
    is kept by overriding :meth:`seen`."""

    #: Where the input, the output and the group sit in a call, by collective: in-place ones
    #: (tensor, op, group); the others (output, input, op, group)
    IN_PLACE = ("all_reduce", "broadcast", "reduce")

    def __init__(self, names: tuple[str, ...], module=None):
        self.names, self.module, self.calls = names, module, []
        self.saved: dict = {}
        self.saved_in_module: dict = {}

    def __enter__(self):
        wrapped, by_id = {}, {}
        for name in self.names:
            if hasattr(dist, name):
                self.saved[name] = original = getattr(dist, name)
                wrapped[name] = self._stand_in(name, original)
                by_id.setdefault(id(original), name)
                setattr(dist, name, wrapped[name])
        for attr, value in list(vars(self.module).items()) if self.module else []:
            if id(value) in by_id:
                self.saved_in_module[attr] = value
                setattr(self.module, attr, wrapped[by_id[id(value)]])
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(dist, name, original)
        for attr, original in self.saved_in_module.items():
            setattr(self.module, attr, original)
        return False

    def _stand_in(self, name: str, original):
        def call(*args, **kwargs):
            record = self.seen(name, args, kwargs)
            done = original(*args, **kwargs)
            if record is not None:
                output = (record["_given"] if name in self.IN_PLACE
                          else argument(args, kwargs, 0, "output", "output_tensor",
                                        "output_tensor_list"))
                record["out"] = flat(output)
                del record["_given"]
            return done
        return call

    def seen(self, name: str, args, kwargs) -> dict | None:
        """Record one call before it is made (a collective that raises was made too)."""
        in_place = name in self.IN_PLACE
        given = (argument(args, kwargs, 0, "tensor") if in_place
                 else argument(args, kwargs, 1, "input", "input_tensor", "input_list",
                               "input_tensor_list"))
        op = argument(args, kwargs, 1 if in_place else 2, "op") or dist.ReduceOp.SUM
        group = argument(args, kwargs, 2 if in_place else 3, "group")
        record = {"name": name, "ranks": ranks_of(group), "op": str(op), "given": flat(given),
                  "out": None, "_given": given}
        self.calls.append(record)
        return record


@dataclass
class Event:
    """One thing that happened: where (``at``), what it is (``kind``: "collective 1", "input of
    collective 1", "shard of parameter 0"), the facts compared (``fact``), in words (``said``),
    and values compared bit for bit after them."""
    at: str
    kind: str
    fact: tuple = ()
    said: str = ""
    values: torch.Tensor | None = field(default=None, compare=False)


def op_of(call: dict) -> str:
    return call["op"].rsplit(".", 1)[-1]  # "RedOpType.AVG": AVG


def collective_events(calls: list[dict], at: str, groups: dict[tuple, str] | None = None
                      ) -> list[Event]:
    """Each recorded call as events: the collective itself (form, group, dtype, elements), then
    what it was handed, bit for bit. What it gave is left out: torch reduces fp32 with AVG where
    a right solution sums and divides, and only the results must agree."""
    events = []
    for k, call in enumerate(calls, 1):
        name = SAME_COLLECTIVE.get(call["name"], call["name"])
        given = call["given"]
        dtype = None if given is None else str(given.dtype).removeprefix("torch.")
        numel = None if given is None else given.numel()
        ranks = call["ranks"]
        group = (groups or {}).get(ranks)
        where = (f"the {group} group {{{', '.join(map(str, ranks))}}}" if group
                 else f"every rank {{{', '.join(map(str, ranks))}}}"
                 if ranks == tuple(range(dist.get_world_size()))
                 else f"the ranks {{{', '.join(map(str, ranks))}}}")
        events.append(Event(at, f"collective {k}", (name, ranks), f"{FORMS.get(name, name)} "
                            f"over {where}"))
        events.append(Event(at, f"input of collective {k} ({name})", (dtype, numel),
                            f"{numel} {dtype} elements", given))
    return events


def value_events(kind: str, tensors: list, at: str) -> list[Event]:
    """Results, one event each: "shard of parameter 0", ..."""
    return [Event(at, f"{kind} {j}",
                  (None if t is None else (tuple(t.shape), str(t.dtype).removeprefix("torch."))),
                  "none" if t is None else f"shape {tuple(t.shape)}, "
                  f"{str(t.dtype).removeprefix('torch.')}", t)
            for j, t in enumerate(tensors)]


@dataclass
class Divergence:
    """The first event where two runs differ: ``line`` in words, ``kind`` of event it is."""
    line: str
    kind: str


def first_divergence(mine: list[Event], torchs: list[Event]) -> Divergence | None:
    """The first event of ``mine`` that is not torch's, in words; None when none differs."""
    for k in range(max(len(mine), len(torchs))):
        a = mine[k] if k < len(mine) else None
        b = torchs[k] if k < len(torchs) else None
        found = _differ(a, b)
        if found:
            at = (a or b).at
            return Divergence(f"{at}: {found.line}" if at else found.line, found.kind)
    return None


def _differ(a: Event | None, b: Event | None) -> Divergence | None:
    """How event ``a`` (yours) is not ``b`` (torch's), in words; None when it is."""
    from course.grader.checks import shown
    if a is None:
        return Divergence(f"your code made no {b.kind}; torch's was {b.said}"
                          if b.kind.startswith("collective") else
                          f"your run ended before torch's {b.kind}", b.kind)
    if b is None:
        return Divergence(f"your {a.kind} was {a.said}; torch made no such "
                          f"{'collective' if a.kind.startswith('collective') else 'step'}",
                          a.kind)
    if a.kind != b.kind and b.kind.startswith("collective"):
        return Divergence(f"your code made no {b.kind}; torch's was {b.said}", b.kind)
    if a.kind != b.kind and a.kind.startswith("collective"):
        return Divergence(f"your {a.kind} was {a.said}; torch made no more collectives", a.kind)
    if a.kind != b.kind:
        return Divergence(f"your {a.kind} is where torch's {b.kind} was ({b.said})", b.kind)
    if a.fact != b.fact:
        return Divergence(f"your {a.kind} was {a.said}; torch's {b.said}", a.kind)
    if a.values is None or b.values is None or torch.equal(a.values, b.values):
        return None
    differ = (a.values != b.values).nonzero()
    at = tuple(differ[0].tolist())
    return Divergence(
        f"your {a.kind} differs from torch's in {len(differ)} of "
        f"{a.values.numel()} elements, first at {list(at)}: "
        f"{shown(a.values[at].item(), b.values[at].item())}", a.kind)


def what_torch_did(calls: list[dict], groups: dict[tuple, str] | None = None) -> str:
    """Torch's collectives in words, with the op each reduced with (AVG: gloo sums, then
    divides by the group's size), for a result that differs after collectives that agreed."""
    events = collective_events(calls, "", groups)
    said = [f"{kind.said} of {given.said}, reduced with {op_of(call)}" for kind, given, call in
            zip(events[::2], events[1::2], calls)]
    return "torch made " + ("; then ".join(said) if said else "no collective")


def verdict(divergence: Divergence | None, known: str | None, about: tuple[str, ...]) -> str:
    """The first divergence, then a known mistake's words only when they speak of the same kind
    of event (``about``: the kinds' first words, "collective", "input", "shard"), and never
    a "could not tell" that the divergence says better."""
    if divergence is None:
        return known or ""
    if not known or "could not tell" in known or not divergence.kind.startswith(about):
        return divergence.line
    return f"{divergence.line}; {known}"
