"""Everything on disk: sharded loading, live export, DCP save and publish, resume, checks, checkpoint export."""
