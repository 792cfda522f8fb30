"""Histogram buckets shared by the gateway's and the workers' Prometheus series, so they compare."""

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 256)
