"""One target across processes: tensor parallelism (each rank its heads and its share of the MLP's
width, an all-reduce after o_proj and after down_proj) and pipeline parallelism (each stage a
contiguous range of layers, the hidden states passed on).

    comm.py           the group: torch.distributed (gloo) for setup and pipeline transfers, and
                      shm_allreduce.c, the all-reduce of ranks on one machine (RankFailure)
    shard.py          cuts a loaded model to one rank's part (RowParallelLinear, a pipeline stage)
    worker.py         a rank's process: loads its part, builds its cache, runs each step it is sent
    group.py          the driver's side: spawns the ranks (RankGroup) and runs the target's steps
                      over them (ParallelRunner, a ModelRunner)

The scheduler, block tables, sampling and the draft stay on the driver (rank 0, which holds a
part too); each step's windows go to the other ranks over a pipe, as host lists. Replicas on Ray
Serve (`specdec.api.cluster`) are the other scaling axis: more engines, not a bigger one.
"""
