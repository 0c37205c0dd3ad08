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
    "17": (
        "One buffer of W equal rows, row r holding rank r's chunk of every gradient (each padded "
        "to chunk 0's rows); a SUM reduce-scatter leaves this rank its row summed; the division by"
        " W is split around the sum: all of it after the sum, except in fp16, where a power of two"
        " (torch's loop: double from 1 while the value divides W and W over it is larger than it) "
        "comes before it, to keep the sum in fp16's range.",
        "divide_factors: (1, W) unless the reduction is in fp16; there, double a factor from 1 "
        "while W is divisible by it and W over it is larger than it, the rest after. "
        "reduce_scatter_gradients: the rows per parameter are the ceiling of its dim 0 over W; "
        "build the buffer rank by rank, parameter by parameter, pad, cast to the reduce dtype; "
        "divide, reduce-scatter, divide; split this rank's row by parameter and cut each piece "
        "back to the shape of its (unpadded) chunk, in the gradient's dtype.",
        """divide_factors:
    if reduce_dtype != torch.float16:
        return 1, world_size
    before = 1
    while world_size % before == 0 and world_size / before > before:
        before *= 2
    return before, world_size / before
reduce_scatter_gradients:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rows = [-(-g.shape[0] // world_size) for g in grads]
    pieces = []
    for r in range(world_size):
        for g, n in zip(grads, rows):
            piece = chunk(g, world_size, r)
            pieces.append(torch.cat([piece, piece.new_zeros(n - len(piece), *g.shape[1:])]))
    buffer = torch.cat([p.reshape(-1) for p in pieces]).to(reduce_dtype)
    before, after = divide_factors(world_size, reduce_dtype)
    buffer.div_(before)
    out = buffer.new_empty(buffer.numel() // world_size)
    reduce_scatter(out, buffer)
    out.div_(after)
    sizes = [n * g[0].numel() for g, n in zip(grads, rows)]
    shards = [chunk(g, world_size, rank) for g in grads]
    return [part[:s.numel()].view_as(s).to(g.dtype)
            for part, s, g in zip(out.split(sizes), shards, grads)]"""),
    "18": (
        "Two sums, each in its own group, each averaged where it is made: inside the node a "
        "reduce-scatter of exercise 17's buffer leaves each rank its row summed over the node's "
        "S ranks (divide by S); across nodes an all-reduce of that row alone sums the R "
        "replicas' rows (divide by R). fp16 is split as in exercise 17, but of every rank's count "
        "S x R: a power of two before the first sum, the rest after the second.",
        "divisions: (1, S, R) unless the reduction is in fp16; there, exercise 17's loop on "
        "W = S x R gives (before, 1, W / before). reduce_gradients: the shard group's size and "
        "this rank's place in it; the layout over it, cast, divided; reduce_scatter into one "
        "row's length in shard_group; divide; all_reduce the row in replicate_group; divide; "
        "shards_of.",
        """divisions:
    if reduce_dtype != torch.float16:
        return 1, shard_size, replicate_size
    world = shard_size * replicate_size
    before = 1
    while world % before == 0 and world / before > before:
        before *= 2
    return before, 1, world / before
reduce_gradients:
    world, rank = dist.get_world_size(shard_group), dist.get_rank(shard_group)
    before, after_scatter, after_all_reduce = divisions(
        world, dist.get_world_size(replicate_group), reduce_dtype)
    buffer = layout(grads, world).to(reduce_dtype)
    buffer.div_(before)
    out = buffer.new_empty(buffer.numel() // world)
    reduce_scatter(out, buffer, shard_group)
    out.div_(after_scatter)
    all_reduce(out, replicate_group)
    out.div_(after_all_reduce)
    return shards_of(out, grads, world, rank)"""),
    "17b": (
        "A unit's full parameters exist only while its forward or its backward runs: gathered just"
        " before, freed just after, except where torch keeps them: the root (the backward needs it"
        " first) and, under ZeRO-2 (reshard_after_forward False), every unit, from forward to "
        "backward. After the backward one collective turns the full gradients into this rank's "
        "rows of their average, which add up in the shards' .grad until the step; without sync "
        "nothing is sent, and the full gradients keep adding up where autograd put them.",
        "before_forward and before_backward: gather when not gathered. after_forward: free when "
        "reshard_after_forward and not the root. after_backward: with sync, reduce_scatter the "
        "list of the full parameters' gradients, then for each shard whose result is not None set "
        "or add its .grad, and set the full parameter's .grad to None; free in both cases. "
        "make_optimizer: optimizer_class over the shards of every unit.",
        """before_forward and before_backward:
    if not self.gathered:
        self.gather()
after_forward:
    if self.reshard_after_forward and not self.is_root:
        self.free()
after_backward:
    if self.requires_gradient_sync:
        reduced = self.reduce_scatter([p.grad for p in self.full])
        for shard, full, mine in zip(self.shards, self.full, reduced):
            if mine is None:
                continue
            if shard.grad is None:
                shard.grad = mine
            else:
                shard.grad += mine
            full.grad = None
    self.free()
make_optimizer:
    return optimizer_class([s for u in units for s in u.shards], **defaults)"""),
}
