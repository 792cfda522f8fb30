"""Generated protobuf and gRPC stubs of protos/reflow/v1 (never edit; run `make protos`)."""
