"""The only tier that imports pika: connections to several hosts, topology, probes, the queues'
figures, the consumer's transport and the relay's confirming publisher.
"""
