"""DMP, the AMQP Direct Message Protocol: sinks and feeds, both roles."""
