"""``p2p-run scale --to N``: ask a running job for a world size (give ranks back, or grow).

    p2p-run scale --to 2 --run-dir runs/job1

The request goes to the job's coordinator as an authenticated control message (the job's
secret, found in its run directory unless ``--secret-file`` says otherwise). The coordinator's
elastic policy turns it into a graceful resize: ranks finish their step, the state is resharded
from peers, given-back ranks leave, and no step is lost. A size outside ``--min-ranks`` ..
``--max-ranks`` is clamped to the nearest allowed size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import zmq

from launcher import protocol
from launcher.coordinator import COORDINATOR_FILE, COORDINATOR_IDENTITY


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        print(f"p2p-run scale: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str]) -> int:
    """Send the request; 0 once it is handed to the coordinator's socket."""
    p = _Parser(prog="p2p-run scale", description=__doc__.splitlines()[0])
    p.add_argument("--to", type=int, required=True, help="the world size to run at")
    p.add_argument("--run-dir", default=None, help="the job's run directory (default runs/<id>)")
    p.add_argument("--job-id", default="p2p-job", help="the job's --job-id (default p2p-job)")
    p.add_argument("--coordinator", default=None, help="host:port (default: from the run dir)")
    p.add_argument("--secret-file", default=None, help="the job's secret (default: the run dir's)")
    args = p.parse_args(argv)
    if args.to < 1:
        p.error("--to must be >= 1")
    run_dir = Path(args.run_dir or Path("runs") / args.job_id)
    address = args.coordinator
    if address is None:
        try:
            info = json.loads((run_dir / COORDINATOR_FILE).read_text())
        except FileNotFoundError:
            p.error(f"no running job in {run_dir} (no {COORDINATOR_FILE}); pass --run-dir")
        address = f"{info['host']}:{info['port']}"
        job_id = info.get("job_id", args.job_id)
    else:
        job_id = args.job_id
    try:
        secret = protocol.read_secret(args.secret_file or str(run_dir / "secret"))
    except ValueError as e:
        p.error(str(e))
    codec = protocol.Codec(secret, job_id, f"operator/{os.getpid()}")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, codec.sender.encode())
    sock.setsockopt(zmq.LINGER, 2000)
    protocol.harden_socket(sock)
    try:
        sock.connect(f"tcp://{address}")
        sock.send_multipart(codec.encode(protocol.SCALE, {"size": args.to}))
    finally:
        sock.close(linger=2000)  # delivered before we go, or given up on after 2 s
        ctx.term()
    print(f"p2p-run scale: asked the job at {address} ({COORDINATOR_IDENTITY}) for {args.to} ranks")
    return 0
