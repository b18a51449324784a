"""The data plane: layout, snapshots, buddy placement and replication of every rank's shard."""
