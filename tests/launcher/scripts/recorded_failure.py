"""A script whose main is decorated with torch's ``@record``, as torchtitan's is: the exception
that ends it goes to ``TORCHELASTIC_ERROR_FILE`` before it exits with code 1."""

import os

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    print(f"rank {os.environ['RANK']} starts", flush=True)
    raise ValueError(f"learning rate -1 is negative (rank {os.environ['RANK']})")


if __name__ == "__main__":
    main()
