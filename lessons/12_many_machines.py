"""Lesson 12: many machines: torchrun on every node, a rendezvous, and the variables it sets.

What this adds since lesson 11: ranks on different machines. The training code does not change;
what changes is how processes find each other with no parent to fork them, no shared file system
to be sure of and no one to hand out ranks: over the network. One
``torchrun`` *agent* per machine (*node*) starts that node's workers. First the agents meet in a
**rendezvous**: with ``--rdzv_backend=c10d`` the agent on ``--rdzv_endpoint=HOST:PORT`` serves a
small store there, every agent joins with the same ``--rdzv_id``, and once ``--nnodes`` have
joined each node gets a ``GROUP_RANK`` (agents sorted by address, then process id) and each
worker the variables ``init_process_group()`` reads: ``RANK`` (among all workers),
``LOCAL_RANK`` (on its node: which GPU), ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
and ``MASTER_ADDR``/``MASTER_PORT``, a *second* store, served by node 0's agent (in torch 2.13;
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` has worker 0 open it instead, which also avoids the
gloo restart trap of lesson 09). With equal nodes ``RANK = GROUP_RANK x LOCAL_WORLD_SIZE +
LOCAL_RANK``, checked here.

Run it on two machines (the same command on each; port 29500 of ``node0`` must be reachable):

    torchrun --nnodes=2 --nproc_per_node=GPUS_PER_NODE --rdzv_backend=c10d \\
             --rdzv_endpoint=node0:29500 --rdzv_id=lesson12 lessons/12_many_machines.py

With SLURM, one agent per node (``--nproc_per_node`` must match ``--gpus-per-node``)::

    #!/bin/bash
    #SBATCH --job-name=lesson12
    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=1
    #SBATCH --gpus-per-node=4
    #SBATCH --cpus-per-task=16
    #SBATCH --time=00:10:00
    head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    srun torchrun --nnodes="$SLURM_NNODES" --nproc_per_node=4 \\
        --rdzv_backend=c10d --rdzv_endpoint="$head:29500" --rdzv_id="$SLURM_JOB_ID" \\
        lessons/12_many_machines.py

Without a second machine the lesson plays the nodes on this one, over loopback, one agent each
(``miniddp.launch.torchrun_agents``: a deadline, nothing left running), with gloo:

    python lessons/12_many_machines.py                    # 2 nodes x 1 worker, gloo on CPU
    python lessons/12_many_machines.py --nnodes 3 --nproc_per_node 2
    torchrun --standalone --nproc_per_node=2 lessons/12_many_machines.py   # 1 node, as before

What you should see: each agent's command, then their output prefixed ``[agent N]``: the
variables every worker received, the two ports, the loss falling, the parameters equal on every
worker and close to a one-process oracle; ``OK: ...``. About 25 s, most of it start-up.
"""

import argparse
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

import miniddp
from course.data import make_dataset, make_model, shard
from course.report import Progress, check, ok, print0
from miniddp.launch import launch, rank_device
from miniddp.launch.torchrun_agents import (
    as_worker,
    free_port,
    run_agents,
    shown,
    started_by_torchrun,
    torchrun,
    verdict,
)

BATCH_SIZE = 32  # per worker
STEPS = 40
LR = 0.2
# The oracle sums each batch's gradient in one matrix product, the workers in shares and then
# an all_reduce: the same sum, rounded in another order (lesson 07). Close, not equal.
ORACLE_TOLERANCE = dict(rtol=1e-4, atol=1e-5)
VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "MASTER_ADDR", "MASTER_PORT")
AGENT = "-"  # which simulated agent started this worker: its --agent, "-" on a real node


# ----- in every worker: what torchrun told it, then a few checked training steps -----

def meet_the_nodes():
    """Every worker reports torchrun's variables; rank 0 prints them; all check them."""
    world = dist.get_world_size()
    mine = {k: os.environ.get(k, "-") for k in VARIABLES}
    mine.update(agent=AGENT, host=socket.gethostname(), pid=os.getpid(),
                agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "-"))
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    print0("what torchrun told each worker (agent: which torchrun started it):")
    print0("  agent  " + "  ".join(f"{k:>{len(k)}}" for k in VARIABLES) + "  host, pid")
    for env in everyone:
        print0(f"  {env['agent']:>5}  " + "  ".join(f"{env[k]:>{len(k)}}" for k in VARIABLES)
               + f"  {env['host']}, {env['pid']}")
    if everyone[0]["agent"] != "-":
        node = {env["GROUP_RANK"] for env in everyone if env["agent"] == "0"}
        print0(f"  agent 0 serves the rendezvous store (is_host=1); its workers are on node "
               f"{', '.join(sorted(node))}: the nodes are numbered by address, then process id "
               "(here all share one address), not by who serves the store")
    where = f"{everyone[0]['MASTER_ADDR']}:{everyone[0]['MASTER_PORT']}"
    if everyone[0]["agent_store"] == "True":
        print0(f"  MASTER_ADDR:MASTER_PORT {where} is a second store, not the rendezvous "
               "endpoint: the agent of node 0 (GROUP_RANK 0) opened it after the rendezvous, "
               "and every worker connects to it (TORCHELASTIC_USE_AGENT_STORE=True)")
    else:
        print0(f"  MASTER_ADDR:MASTER_PORT {where}: a port that the agent of node 0 picked; "
               "worker 0 opens the store there (TORCHELASTIC_USE_AGENT_STORE is not True)")
    for rank, env in enumerate(everyone):
        check(env["RANK"] == str(rank) and env["WORLD_SIZE"] == str(world),
              f"worker {rank} was told RANK={env['RANK']}, WORLD_SIZE={env['WORLD_SIZE']}")
        if env["GROUP_RANK"] != "-":  # set by torchrun, not by every launcher
            node_rank, local = int(env["GROUP_RANK"]), int(env["LOCAL_RANK"])
            check(rank == node_rank * int(env["LOCAL_WORLD_SIZE"]) + local,
                  f"RANK {rank} is not GROUP_RANK x LOCAL_WORLD_SIZE + LOCAL_RANK for {env}")
    return len({env["GROUP_RANK"] for env in everyone})


def sgd_step(model, velocities, momentum=0.9):
    """SGD with momentum, as torch.optim.SGD computes it, written out: the constructor of a
    torch.optim optimizer imports torch._dynamo (its ``add_param_group`` is wrapped in
    ``torch._disable_dynamo``), a second or two in every fresh worker that this lesson would wait
    for.
    """
    with torch.no_grad():
        for p, v in zip(model.parameters(), velocities):
            v.mul_(momentum).add_(p.grad)
            p.add_(v, alpha=-LR)


def train_and_check(device):
    """A few steps of miniddp's DDP; the same steps in one process on the whole batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    data = make_dataset(n=2048, seed=0)
    mine = shard(data, rank, world)  # every worker its share, whichever node it is on
    loader = DataLoader(mine, batch_size=BATCH_SIZE, drop_last=True)
    everything = DataLoader(Subset(data, range(len(mine) * world)),
                            batch_size=world * BATCH_SIZE, drop_last=True)
    ids = [device.index] if device.type == "cuda" else None
    ddp = miniddp.DistributedDataParallel(make_model(seed=0).to(device), device_ids=ids)
    oracle = make_model(seed=0).to(device)
    velocities = {m: [torch.zeros_like(p) for p in m.parameters()] for m in (ddp, oracle)}
    progress = Progress(STEPS, every=STEPS // 4)
    print0("training (ms/step: miniddp's DDP and the one-process oracle, a step each):")
    step = 0
    while step < STEPS:
        for (x, y), (big_x, big_y) in zip(loader, everything):
            for model, inputs, targets in ((ddp, x, y), (oracle, big_x, big_y)):
                model.zero_grad()
                loss = F.mse_loss(model(inputs.to(device)), targets.to(device))
                loss.backward()
                sgd_step(model, velocities[model])
                if model is ddp:
                    progress(loss)
            step += 1
            if step == STEPS:
                break

    losses = progress.losses()
    check(losses[-1] < 0.3 * losses[0],
          f"the loss went from {losses[0]:.4f} to {losses[-1]:.4f}, not below 30% of it")
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    bits = [t.view(torch.int32) for t in everyone]  # fp32 bits: 0.0 and -0.0 differ here
    check(all(torch.equal(bits[0], other) for other in bits),
          "the workers ended with different parameters: gradients were not averaged across "
          "nodes")
    expected = torch.cat([p.detach().reshape(-1) for p in oracle.parameters()])
    worst = (flat - expected).abs().max().item()
    print0(f"parameters equal on all {world} workers, bit for bit; largest difference from the "
           f"one-process oracle (batch {world * BATCH_SIZE}): {worst:.2g}")
    check(torch.allclose(flat, expected, **ORACLE_TOLERANCE),
          f"rank {rank}: the parameters left the one-process oracle (max difference {worst:.3g})")
    return losses[0], losses[-1]


def on_every_rank():
    device = rank_device()
    nodes = meet_the_nodes()
    first, last = train_and_check(device)
    return nodes, dist.get_world_size(), first, last


# ----- run plainly: play every node on this machine, one torchrun agent per node -----

def agent_command(nnodes, nproc_per_node, port, hosts_the_store, agent):
    """The torchrun command of one simulated node.

    Real nodes all run the same command, and the one whose address is the endpoint's hosts the
    rendezvous store. Here every agent's address is the endpoint's, so each is told whether it
    hosts (``is_host``): the host then fails at once, with "address already in use", if another
    program holds the port, instead of every agent connecting to that program and waiting.
    ``--monitor_interval=0.1`` is the default since torch 2.4; before, an agent looked at its
    workers every 5 seconds, and noticed that they had finished up to 5 seconds late.
    """
    return torchrun(f"--nnodes={nnodes}", f"--nproc_per_node={nproc_per_node}",
                    "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                    f"--rdzv_id=lesson12-{port}", f"--rdzv_conf=is_host={int(hosts_the_store)}",
                    "--monitor_interval=0.1", str(Path(__file__).resolve()), "--backend", "gloo",
                    "--agent", str(agent))


def simulate_nodes(nnodes, nproc_per_node, timeout):
    """Play ``nnodes`` machines on this one; return the port and the workers' OK message."""
    for attempt in range(3):
        port = free_port()  # another program may take it before the host agent does
        commands = [agent_command(nnodes, nproc_per_node, port, i == 0, i)
                    for i in range(nnodes)]
        for i, command in enumerate(commands):
            print(f"agent {i}: {shown(command)}", flush=True)
        done = run_agents(commands, [f"[agent {i}] " for i in range(nnodes)], timeout)
        collided = any("address already in use" in out.lower() for out in done.outputs)
        if not (collided and done.failed and attempt < 2):
            break
        print(f"port {port} was taken by another program meanwhile: trying another one")
    return port, verdict(done)[len("OK: "):]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nnodes", type=int, default=2, help="machines to play (run plainly)")
    parser.add_argument("--nproc_per_node", "--nproc-per-node", type=int, default=1,
                        help="workers per simulated machine (run plainly)")
    parser.add_argument("--timeout", type=float, default=90.0,
                        help="seconds before the simulated nodes are stopped (run plainly)")
    parser.add_argument("--backend", default=None,
                        help="process group backend for the workers (default: NCCL when every "
                             "worker of a node has a GPU, gloo otherwise)")
    parser.add_argument("--agent", default="-",
                        help="which simulated agent started this worker (set by the simulation)")
    args = parser.parse_args()
    global AGENT
    AGENT = args.agent
    if started_by_torchrun():  # on a real node or a simulated one
        nodes, world, first, last = as_worker(lambda: launch(on_every_rank,
                                                             backend=args.backend)[0])
        ok(f"{world} workers on {nodes} node(s): the loss fell {first:.3f} -> {last:.4f}, "
           f"parameters equal everywhere and close to the one-process oracle")
    else:
        port, workers_said = simulate_nodes(args.nnodes, args.nproc_per_node, args.timeout)
        print(f"OK: {args.nnodes} torchrun agents met at 127.0.0.1:{port} (c10d rendezvous) "
              f"and ran {workers_said}")


if __name__ == "__main__":
    main()
