"""What a rank trains on: seeded sources every rank slices the same way (sources), local datasets
tokenized once into a cached token file (datasets), their files inside the data roots (datafiles),
and content digests of the files a job loads (digests).

May import: workers.config, workers.records, workers.memory.
"""
