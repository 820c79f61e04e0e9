"""AMQP 0-9-1 reply codes the app acts on (the broker's reason for closing a channel), named
once."""

# A passive declare of something that does not exist, or a publish to a missing exchange: the
# expected "no" of the app's probes.
NOT_FOUND = 404
