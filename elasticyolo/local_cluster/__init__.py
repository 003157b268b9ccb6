"""Real local servers for tests, benchmarks and the demo (etcd, S3 API via moto). Loopback only."""
