"""The dead-letter admin through Django's test client."""
