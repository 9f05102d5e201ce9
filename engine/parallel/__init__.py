"""Tensor and expert parallelism (docs/parallel.md): one engine driving N rank processes.

`plan.py` decides which heads, MLP columns and experts each rank owns and rewrites the checkpoint's
config for one rank; `sharded_weights.py` hands a rank only its slices of the checkpoint tensors;
`comm.py` is the process group and the one collective the models call (`RankComm.all_reduce`);
`driver.py` is rank 0's model (broadcasts each step's inputs, then runs its own shard);
`worker.py` loads one rank's share (`load_shard`, with the load function it is handed) and is the
loop of ranks 1..N-1; `launch.py` starts them all. The loader (engine/loading/) calls in here and
passes `load_model` down; nothing here imports it back.
"""
