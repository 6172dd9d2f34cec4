"""The RabbitMQ Stream protocol: the listener over the embedded log (and later the client)."""
