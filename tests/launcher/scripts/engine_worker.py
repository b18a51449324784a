"""A rank (or spare) that speaks the control plane and does no training: for launcher tests.

It acknowledges every generation and exits 0 when the job shuts down, when its agent says no
coordinator is left, or when ``stop`` appears in the run directory. ``--import-torch`` makes it
import torch first, as a real spare would; ``--say`` makes it print a line per generation.
"""

import os
import sys

if "--import-torch" in sys.argv:
    import torch  # noqa: F401

from launcher.client import ClientConfig, ControlClient, ControlPlaneTimeout

config = ClientConfig.from_env()
rank = int(os.environ["RANK"]) if config.role == "rank" else None
client = ControlClient(config, rank=rank)


def say(what: str) -> None:
    if "--say" in sys.argv:
        print(f"{config.identity} {what}", flush=True)


try:
    if config.role == "spare":
        say("waits")
        try:
            assigned = client.wait_for_assignment(timeout_s=600)
        except RuntimeError:  # the job ended, or lost every coordinator, before it was needed
            sys.exit(0)
        client.ack(assigned["generation"])
        say(f"is rank {client.rank} in generation {assigned['generation']}")
    stop_file = os.path.join(os.environ["P2P_RUN_DIR"], "stop")
    while not os.path.exists(stop_file):
        try:
            kind, body = client.next_event(timeout_s=0.1)
        except ControlPlaneTimeout:
            continue
        if kind == "generation":
            client.ack(body["generation"])
            say(f"is rank {client.rank} in generation {body['generation']}")
        elif kind in ("shutdown", "coordinators_lost"):
            break
finally:
    client.close()
