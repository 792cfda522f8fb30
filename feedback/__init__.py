"""feedback: Kafka intake, the SQLAlchemy store, the demo task, training and the MLflow registry."""
