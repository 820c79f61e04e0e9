"""What operators read: the status report and its judgement, the readers and scrape collectors, the
health and metrics views, the process's own HTTP server."""
