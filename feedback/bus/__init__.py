"""The feedback bus: Kafka topics and clients, the embedded broker, the outbox and the publisher."""
