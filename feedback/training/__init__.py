"""Training: datasets from feedback, the base model, the fine-tune trainer and its gate, the job."""
