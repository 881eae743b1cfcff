"""The data layer: datasets, samplers, generators and collation. Nothing here knows about workers."""
