"""One target across processes and machines: tensor parallelism (each rank its heads and its
share of the MLP's width; o_proj and down_proj split exactly, by output rows with their inputs
gathered, or by inputs with their partial sums added) and pipeline parallelism (each stage a
contiguous range of layers, the hidden states passed on).

    comm.py           the group: torch.distributed (gloo) for setup and pipeline transfers, and
                      shm_allreduce.c, the all-reduce of ranks on one machine (RankFailure)
    shard.py          a rank's part: what it loads (load_part), how a layer is cut (cut_layer:
                      ColumnParallelLinear / RowParallelLinear), a pipeline stage
    worker.py         a rank: loads its part, builds its cache, runs each step it is sent
    launch.py         where ranks run: spawned processes on this machine, or Ray actors in a
                      placement group (on this machine or others)
    group.py          the driver's side: starts the ranks (RankGroup) and runs the target's steps
                      over them (ParallelRunner, a ModelRunner)

The scheduler, block tables, sampling and the draft stay on the driver (rank 0, which holds a
part too); each step's windows go to the other ranks over their control connection, as host
lists. Replicas on Ray Serve (`specdec.api.cluster`) are the other scaling axis: more engines,
not a bigger one; with --tp / --pp each replica is a group of ranks.
"""
