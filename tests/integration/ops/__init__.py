"""Status, health, metrics and the ops views against the real services."""
