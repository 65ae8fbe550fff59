#!/bin/bash
# One training task under srun: torch.distributed's variables from Slurm's, then the command.
export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS
exec "$@"
