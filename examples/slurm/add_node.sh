#!/bin/bash
# Add a node to a running p2p-run job under Slurm (e.g. to replace a lost one):
#
#   examples/slurm/add_node.sh JOBID NODE NODE_RANK
#
# NODE must belong to the job's allocation (sbatch -N3 for a job that starts on 2 nodes), and
# NODE_RANK must be one no node of the job has used yet (the start's nodes are 0..N-1, so the
# first node added is N). The node joins as capacity: its processes are spares that the job
# hands lost ranks to. It needs the same run directory and p2p-run flags as the job's script
# (P2P_NPROC, P2P_SPARES, P2P_SHARED, P2P_ARGS, TRAIN_ARGS), and the job must have started
# with --max-ranks above its start size (train.sbatch's --nnodes START:ALLOCATED does that).
set -eu
JOBID=$1 NODE=$2 NODE_RANK=$3
NPROC=${P2P_NPROC:-2}
SPARES=${P2P_SPARES:-1}
SHARED=${P2P_SHARED:-$PWD/runs}
RUN_DIR=$SHARED/$JOBID
NODES=${P2P_NODES:-$NODE_RANK}
ALLOCATED=$(squeue -h -j "$JOBID" -o %D)
exec srun --jobid="$JOBID" --no-kill -N1 -n1 -w "$NODE" --job-name="p2p-node$NODE_RANK" \
    p2p-run --nnodes "$NODES:$ALLOCATED" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC" \
    --spares "$SPARES" --allowed-sizes "$((NODES * NPROC))" --run-dir "$RUN_DIR" \
    --checkpoint-dir "$RUN_DIR/checkpoints" --checkpoint-every 10 ${P2P_ARGS:-} \
    examples/train.py --out "$RUN_DIR/out" ${TRAIN_ARGS:-}
