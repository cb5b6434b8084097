"""The golden across torchrun ranks: a pipeline of stages, each rank its own layers.
stage (a rank's layers, what is carried between stages), calls (what rank 0 and the workers
share), driver (rank 0's side), worker (ranks > 0), model (the per-prompt commands' entry:
run_ranks, command_target, arm_numerics)."""
