"""The benchmark harness's own tests (of benchmarks/stoker_bench and the scripts beside it),
kept beside the harness and run by `make test` (pyproject's `testpaths`). They import the
harness as `stoker_bench` (pyproject's pytest `pythonpath` holds benchmarks/) and, where they
need them, the tests' shared helpers as `tests.support`; stoker's tests never import these."""
