"""The fabric: bring up the engine nodes of one component (prefill or decode) under srun or mpiexec, check the links
between them with real NIXL transfers, start the engines and announce them to the router.

The contract launchers rely on:

    python -m llmd.fabric --spec SPEC --run-dir DIR --role {prefill,decode}
        [--preflight-mib N] [--min-gbps X] [--no-preflight]
        [--preflight-iterations K] [--launch-mode head-headless|per-rank] [--startup-timeout S] [--python PY]

started as ONE TASK PER NODE of the component: under `srun` (one task per node), `mpiexec -n N` locally, or as a
single process without a launcher (1 node). It

1. takes rank and size from mpi4py (COMM_WORLD = the tasks of this component; under srun without a working PMI every
   task is an MPI singleton, and rank/size come from SLURM_PROCID/SLURM_NTASKS with the exchange going through files
   in DIR/.fabric/), allgathers node names (SLURMD_NODENAME or the hostname) and addresses (LLMD_NODE_ADDRESS, the
   Slurm NodeAddr, 127.0.0.1 when all ranks share a host, else the hostname's address), orders the nodes as
   `scontrol show hostnames` lists the component (the step's node list, SLURM_JOB_NODELIST_HET_GROUP_<k> in a het
   job) or by rank, and plans every node (llmd.fabric.plan: replica, DP ranks, ports, argv/env, discovery entries;
   rank 0 writes it to DIR/fabric-<role>-plan.json). The pool must have exactly as many nodes as there are tasks.
2. runs the preflight (llmd.fabric.preflight) unless --no-preflight: N MiB (default 64) WRITEs between every ordered
   pair of ranks, one pair at a time, with UCX; rank 0 writes the GB/s matrix to DIR/fabric-<role>.h5
   (/fabric/<role>, see llmd.fabric.record; merge_runs carries it into the run file). A link below --min-gbps
   (default 1; 0 disables) or a failed/corrupted transfer makes every rank exit with code 3, naming each link:
   `prefill rank 1 (node2) -> rank 3 (node4): 0.41 GB/s < 1 GB/s`.
3. settles the ports vLLM cannot bind as 0 (llmd.fabric.settle): each DP replica's `--data-parallel-rpc-port`, on
   the replica's head node, and every vLLM process's NIXL side-channel base, on the node that runs it (a replica's
   headless nodes too): the layout's where free there, else (or with `port: auto`) a free one, the first node at each
   address choosing for every node at it; one allgather tells every node, the replica head's discovery entry lists
   each rank's side-channel port, and rank 0 writes the plan again if a port changed.
4. starts this node's engine processes (engine.kind sim: `llmd engine sim` on the layout's ports and the node's address;
   vllm: llmd.engines.vllm.vllm_launches with addresses resolved, each port taken on the node handed to vLLM to pick, a
   headless node's KV-event ports too, never its agreed side channel), logs in DIR/logs/engines/<name>.log, waits for
   /health, then appends the node's entries, with the ports bound, to DIR/discovery.json (llmd.discovery: locked,
   atomic; the router reloads it on mtime). SIGTERM/SIGINT stop the engines and exit 0; an engine that dies makes the
   task exit with the engine's status (128+signal if killed), its log tail on stderr and, as the last line,
   `<name>: engine exited with code <rc>`, so `srun --kill-on-bad-exit` ends the job with a cause to report (under
   mpiexec only that rank ends: MPI is finalised by then, and hydra lets finalised ranks exit as they like). Engines
   get PDEATHSIG: a task killed outright (SIGKILL, OOM) takes its engines with it.
   User mistakes (spec, node count) exit 2 with a message; every rank prints what it saw.

MPI is only used before the engines start and is finalised by all ranks together; no rank ever waits in a blocking
MPI call (Ibarrier + Test + sleep), which on small nodes would spin a core the transfers need. Until then a failure on
one rank alone (a probe's error, a bug) stops every rank at once (llmd.fabric.bootstrap.failing_together: the rank
prints why, then MPI_Abort with its exit code, or under the file exchange a `failed.<rank>` file the others' waits
read): left alone, the others would wait at their next collective step for its 600 s timeout and the failed rank in
MPI_Finalize for them.
"""
