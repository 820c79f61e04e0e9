"""publish() and the relay against the real database and broker."""
