"""Pure logic, standard library only (no Django, no pika): envelopes, outcomes and failure reasons,
retry decisions, backoff, routing, fingerprints, uuid7."""
