"""Dead letters: recording them, and replaying them to the consumer that failed."""
