"""The gateway's OpenAI-compatible HTTP face: FastAPI routes over the same service as gRPC."""
