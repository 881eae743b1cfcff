"""Tools built on the public API: the benchmark and the `stoker` command."""
