"""Intake: records from Kafka into the store, JSONL files onto Kafka, and what the pipeline holds."""
