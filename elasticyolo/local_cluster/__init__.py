"""A local cluster on 127.0.0.1 for the demo, the chaos replay, tests and benchmarks: real etcd and
S3 API (moto) servers, a cloud metadata server, real agent processes, CPU slices per simulated node,
worker traces, and the one wait helper. Loopback only."""
