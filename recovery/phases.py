"""The names of a recovery's phases, as :class:`recovery.records.RecoveryRecord` records them.

Defined once here and shared by the engine, the benches, the demo and the tests (this module
imports nothing, so the control plane and the report tools can use it without torch).
"""

from __future__ import annotations

INTERRUPT = "interrupt"
"""From the coordinator's word (or a failed collective, if first) to the training thread out of
the step and the generation's groups broken."""
WAIT = "wait"
"""From then to the coordinator's generation, if it came later."""
COMMUNICATORS = "communicators"
"""Joining the new generation's process groups (a spare replacing a rank: from the
generation's arrival)."""
PLAN = "plan"
"""The census of the copies, the choice of the source, the restore plan."""
BUILD = "build"
"""The user's factory on the new groups."""
TRANSFER = "transfer"
"""The bytes from the peers that hold them."""
RESTORE = "restore"
"""Writing the bytes (or a cold checkpoint) into the new model and optimizer."""
DATA = "data"
"""The loader's position and the user state."""
REPLICATE = "replicate"
"""The new replicator, and the first copy of the restored step."""
CHECKPOINT = "checkpoint"
"""Catching up the cold checkpoint a fault cut short."""

#: A rank's own work in a recovery, in order (what the bench puts on the critical path).
RANK_PHASES = (COMMUNICATORS, PLAN, BUILD, TRANSFER, RESTORE, DATA, REPLICATE)
#: What a rank records before its recovery proper (the bench cuts that span on its own clock).
BEFORE_RANK_PHASES = (INTERRUPT, WAIT)
#: The phases every survivor of a recovery from peers records.
PEER_RECOVERY_PHASES = (INTERRUPT, COMMUNICATORS, PLAN, BUILD, TRANSFER, RESTORE, REPLICATE)
#: The phases the engine announces to hooks (``recovery_phase``), where a fault can be injected.
ANNOUNCED_PHASES = (COMMUNICATORS, PLAN, BUILD, TRANSFER, RESTORE, REPLICATE)
