"""Writes to both streams the way training scripts do: whole lines, a last line with no
newline, and (rank 1) more than a pipe holds, before it exits."""

import os
import sys

rank = os.environ["RANK"]
print(f"step 1 loss 2.5 on rank {rank}", flush=True)
print(f"a warning on rank {rank}", file=sys.stderr, flush=True)
if rank == "1":
    for i in range(16384):
        sys.stdout.write(f"{i:063d}\n")
sys.stdout.write(f"done {rank}")
