"""Many sources, one stream (issue 34, under construction): weighted mixing and sequence
packing as functions of their input sequence, so that they resume exactly on any world size.
Nothing here is public yet."""
