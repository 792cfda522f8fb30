"""What the tests share: models, registries, brokers, in-process stacks, the CLI, waiting. Tests
import from here, never from one another."""
