"""Consuming deliveries: the service, its threads, the inbox pipeline and its stages."""
