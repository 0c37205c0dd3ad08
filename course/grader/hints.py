"""The hints of lessons/grade.py, in three steps each: the idea, then the shape of the code, then
its lines. A learner who is stuck asks for the idea first (``--hint NN``) and for more only if
the idea was not enough (``--hint NN --step 2``, ``--step 3``), so that a hint leaves some of
the exercise to do."""

HINTS = {
    "03": (
        "Each rank holds its own gradient; a SUM over the ranks of each gradient scaled by "
        "1 / world_size is the mean. torch scales first, then sums, and rounds that way: "
        "the same arithmetic in the same order gives its bits.",
        "For each parameter that has a gradient: one in-place multiplication of p.grad, then "
        "one blocking all_reduce of p.grad itself (not of a copy), with the default op.",
        """For each parameter with a gradient, two in-place calls:
    p.grad.mul_(1.0 / world_size)   # the reciprocal first: torch's arithmetic
    dist.all_reduce(p.grad)         # a SUM over the ranks, written into p.grad"""),
    "04": (
        "Every rank computes the same whole order (the same seeded shuffle, on a generator "
        "of its own: the process-wide RNG is left alone), pads it so that it splits evenly, "
        "and keeps every num_replicas-th index of it.",
        "Three steps: the order (a permutation from a torch.Generator seeded with seed + "
        "epoch, or range); num_samples and total_size (floor with drop_last, ceiling "
        "without); the order repeated from its start up to total_size, then a strided slice "
        "starting at rank.",
        """Step 1: g = torch.Generator(); g.manual_seed(seed + epoch);
    order = torch.randperm(dataset_len, generator=g).tolist()
Steps 2 and 3:
    if drop_last:
        num_samples = dataset_len // num_replicas
    else:
        num_samples = -(-dataset_len // num_replicas)   # ceil in integers
    total_size = num_samples * num_replicas
    order = (order * -(-total_size // dataset_len))[:total_size]   # repeated, then cut
    return order[rank:total_size:num_replicas]"""),
    "05": (
        "Walk the parameters in model order, one open bucket per dtype: a parameter always "
        "joins the open bucket, and the bucket closes as soon as it holds at least its limit "
        "(the first of each dtype has its own). Torch launches the last bucket first.",
        "In the loop: add the parameter's index and bytes to its dtype's entry, then compare "
        "the bytes with the limit (first_bytes for that dtype's first bucket, cap_bytes after) "
        "and close the bucket if reached. After it: close the open ones, sort by smallest "
        "index, reverse.",
        """In the loop:
    entry[0].append(i); entry[1] += p.numel() * p.element_size()
    if entry[1] >= (first_bytes if entry[2] == 0 else cap_bytes):
        closed.append(entry[0])
        entry[0], entry[1], entry[2] = [], 0, entry[2] + 1
After it:
    closed += [members for members, _, _ in open_buckets.values() if members]
    return list(reversed(sorted(closed, key=min)))"""),
    "06": (
        "Each gradient is scaled into its bucket as it arrives; a bucket is launched when it "
        "is complete AND every bucket before it has been launched, so launches go in bucket "
        "order. When the last one is launched, the autograd engine is asked to run _finish "
        "after the backward, which waits for every bucket and copies it back.",
        "_on_ready: scale into the view, count the gradient in, then a loop launching the "
        "next buckets while they are complete, queueing _finish after the last launch. "
        "_finish: wait for each work in order, copy each bucket's views into .grad, reset "
        "the counts and the in-flight list.",
        """_on_ready:
    torch.mul(param.grad, 1.0 / self.world_size, out=view)
    self.missing[b] -= 1
    while len(self.in_flight) < len(self.buckets) and self.missing[len(self.in_flight)] == 0:
        k = len(self.in_flight)
        self._record("launch", k)
        self.in_flight.append(dist.all_reduce(self.flat[k], async_op=True))
        if k == len(self.buckets) - 1:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
_finish:
    for b, work in enumerate(self.in_flight):
        work.wait()
        for i in self.buckets[b]:
            self.params[i].grad.copy_(self.views[i][1])
    self.missing = [len(members) for members in self.buckets]
    self.in_flight = []"""),
    "07": (
        ".grad accumulates over backwards until it is cleared, so k backwards of loss / k add "
        "up to the gradient of the mean loss. Only the last backward needs to average over "
        "the ranks: the others run with synchronization off.",
        "Clear the gradients once; a loop over the micro-batches where the forward AND "
        "backward of all but the last are inside the no_sync context and the last's are "
        "not; one optimizer step after the loop.",
        """optimizer.zero_grad()
for j, (x, y) in enumerate(micro_batches):
    if j < k - 1:
        with ddp.no_sync():
            (F.mse_loss(ddp(x), y) / k).backward()
    else:
        (F.mse_loss(ddp(x), y) / k).backward()
optimizer.step()"""),
    "15": (
        "Every rank computes the same owners, so nobody has to be told; each rank's "
        "optimizer only knows its own parameters and steps them; then every parameter is "
        "broadcast from its owner, so every rank ends with all of them stepped.",
        "owners: a greedy loop over the parameters sorted by size, largest first, giving each "
        "to the least-loaded rank. __init__: the optimizer class over the parameters whose "
        "owner is this rank, with the defaults. step: the local step, then one blocking "
        "broadcast per parameter, in model order, from its owner.",
        """owners:
    result, load = [0] * len(params), [0] * world_size
    for i in sorted(range(len(params)), key=lambda i: params[i].numel(), reverse=True):
        result[i] = load.index(min(load))
        load[result[i]] += params[i].numel()
    return result
__init__:
    mine = [p for p, owner in zip(self.params, self.owners) if owner == self.rank]
    self.local = optimizer_class(mine, **defaults)
step:
    self.local.step()
    for p, owner in zip(self.params, self.owners):
        dist.broadcast(p, src=owner)"""),
}
