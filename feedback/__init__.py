"""feedback: the learning loop — event schemas, the Kafka bus, intake into the store, tasks, training,
experiments and the scheduler that runs their jobs."""
