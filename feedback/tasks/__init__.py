"""Tasks users ask of the models: the `Task` seam, the `arith` demo task, simulated users."""
