"""Datasets bigger than the machine: shards at a URL, a bounded local cache, a shard-aware
shuffle. The public names are in `stoker.shards`."""
