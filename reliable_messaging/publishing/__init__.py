"""Publishing: publish() into the outbox, and the relay that sends its rows with confirms."""
