"""AMQP 0-9-1 reply codes the app acts on (the broker's reason for closing a channel or a
connection), named once."""

# A passive declare of something that does not exist, or a publish to a missing exchange: the
# expected "no" of the app's probes.
NOT_FOUND = 404
# A redeclare with other arguments, a delete of a queue in use, a body over max_message_size.
PRECONDITION_FAILED = 406
# A method the broker refuses outright (an exchange type whose plugin is not enabled).
COMMAND_INVALID = 503
