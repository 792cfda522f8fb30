"""gateway: the public Inference gRPC server — auth, quotas, validation, routing and the streaming relay."""
