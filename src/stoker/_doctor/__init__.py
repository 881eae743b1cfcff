"""`stoker doctor MODULE:FACTORY`: is the data loader the bottleneck, and how should it be set?

The factory returns a dataset or a DataLoader (stoker's, stoker.torch's or torch's). The
doctor measures, within a time budget planned up front:

    profile      dataset[i] in this process over a spread of indices, collate, batch bytes
    headroom     the rate of a "free" loader: a few cached batches replayed to a consumer
    sweep        num_workers 0..usable CPUs x processes/threads, then prefetch factors at
                 the best count: steady-state samples/s, time to first batch, and per
                 worker process USS/PSS (/proc/<pid>/smaps_rollup) after the first batch
                 and at the end of the run
    readiness    with --step-ms: the recommended configuration behind a consumer that
                 sleeps one model step per batch; the fraction of time it did not wait
    traps        Python object containers under fork, global RNGs drawn in __getitem__,
                 a small /dev/shm, CUDA initialised before fork, more workers than CPUs

Every configuration runs through stoker (`stoker.torch.DataLoader` for torch loaders and
torch tensors, `stoker.DataLoader` otherwise) with an endless copy of the user's sampler, so
that no epoch boundary lands inside a measuring window; each iterator is closed before the
next configuration starts, so no worker outlives its row. The parts are separate: loading
the target (`load_target`, `Target`), measuring (`profile_fetch`, `replay_rate`,
`measure_config`, `measure_readiness`), choosing (`choose`), the traps (`find_traps`) and
rendering (`render`, `plot`, `to_json`); `run` plans the budget and ties them together.

The package, one concern per module (imports point down this list): `target` (loading and
describing the target, `Config`), `probe` (the profile in this process, the headroom),
`memory` (worker processes and their memory), `measure` (one configuration, readiness),
`traps`, `sweep` (the budget, the sweep, choosing, `run` and its `Report`), `report` (the
text and the JSON), `plot` (the chart) and `cli` (the `stoker` command). This package module
imports none of them: the `stoker` command's module is here, and `stoker --help` needs none of
the measuring code, which imports the loader and numpy. Import each name from its module.
"""
