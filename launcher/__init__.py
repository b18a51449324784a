"""The control plane: coordinator, node agents, heartbeats, generations and the ``p2p-run`` CLI."""
