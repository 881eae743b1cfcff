"""What test files share, imported as `tests.support.<module>` (pyproject's pytest `pythonpath`
puts the repo root on sys.path; a test's child script puts it there itself):

- `processes`: the start methods this platform has (`START_METHODS`);
- `leakcheck`: what a test may not leave behind (the `Snapshot` the leak check takes);
- `s3server`: a moto S3 server on loopback (`S3Server`) and the `FaultProxy` in front of it;
- `namespaces`: loopback-only network namespaces for tests that start ranks;
- `docblocks`: the documentation's code blocks, found and run;
- `identity_cases`: the stream identity cases shared by the unit and shard tiers.

The benchmark harness imports `s3server` from here too; nothing here imports tests or the
harness.
"""
