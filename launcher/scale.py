"""``p2p-run scale --to N``: ask a running job for a world size (give ranks back, or grow).

    p2p-run scale --to 2 --run-dir runs/job1

The request goes to the job's coordinator as a control message signed with the job's
*operator key* (``<run-dir>/operator.key``, made by p2p-run on node 0, mode 0600; or
``--operator-key``): the ranks' secret alone cannot resize a job. The coordinator answers the
first request with its run nonce (a challenge) and takes the request sent again with it, so a
request captured in another run never counts. The coordinator's elastic policy turns it into a
graceful resize: ranks finish their step, the state is resharded from peers, given-back ranks
leave, and no step is lost. A size outside ``--min-ranks`` .. ``--max-ranks`` is clamped to
the nearest allowed size.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

import zmq

from launcher import protocol
from launcher.coordinator import COORDINATOR_FILE, COORDINATOR_IDENTITY
from launcher.secret import OPERATOR_KEY_FILE

#: How long the coordinator's challenge is awaited.
_CHALLENGE_TIMEOUT_S = 10.0
#: How long one request waits for the challenge before it goes again.
_RETRY_S = 2.0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"p2p-run scale: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str]) -> int:
    """Send the request; 0 once it went out with the job's run nonce."""
    p = _Parser(prog="p2p-run scale", description=__doc__.splitlines()[0])
    p.add_argument("--to", type=int, required=True, help="the world size to run at")
    p.add_argument("--run-dir", default=None, help="the job's run directory (default runs/<id>)")
    p.add_argument("--job-id", default="p2p-job", help="the job's --job-id (default p2p-job)")
    p.add_argument("--coordinator", default=None, help="host:port (default: from the run dir)")
    p.add_argument(
        "--operator-key",
        default=None,
        help=f"the job's operator key (default: <run-dir>/{OPERATOR_KEY_FILE})",
    )
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
        key = protocol.read_secret(args.operator_key or str(run_dir / OPERATOR_KEY_FILE))
    except ValueError as e:
        p.error(f"{e} (--operator-key)")
    sender = f"operator/{os.getpid()}"
    codec = protocol.Codec(key, job_id, sender)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, protocol.routing_id(sender).encode())
    sock.setsockopt(zmq.LINGER, 2000)
    protocol.harden_socket(sock)
    try:
        sock.connect(f"tcp://{address}")
        # The coordinator answers with its run nonce; drain() sends the request again with it.
        # Unanswered, it goes again on a fresh connection (one refused over the coordinator's
        # cap of unauthenticated connections is not retried by ZeroMQ itself).
        deadline = time.monotonic() + _CHALLENGE_TIMEOUT_S
        next_try = 0.0
        while not codec.run:
            now = time.monotonic()
            if now >= next_try:
                if next_try:
                    with contextlib.suppress(zmq.ZMQError):  # a refused connection is gone
                        sock.disconnect(f"tcp://{address}")
                    sock.connect(f"tcp://{address}")
                with contextlib.suppress(zmq.Again):  # not connected: the next try sends it
                    sock.send_multipart(
                        codec.encode(protocol.SCALE, {"size": args.to}), zmq.NOBLOCK
                    )
                next_try = now + _RETRY_S
            left_s = min(deadline, next_try) - now
            if deadline <= now:
                print(
                    f"p2p-run scale: error: no answer from the coordinator at {address} within "
                    f"{_CHALLENGE_TIMEOUT_S:.0f}s (is the job running, and is this its "
                    "operator key?)",
                    file=sys.stderr,
                )
                return 1
            if sock.poll(int(max(0.0, left_s) * 1000)):
                codec.drain(sock)
    finally:
        sock.close(linger=2000)  # delivered before we go, or given up on after 2 s
        ctx.term()
    print(f"p2p-run scale: asked the job at {address} ({COORDINATOR_IDENTITY}) for {args.to} ranks")
    return 0
