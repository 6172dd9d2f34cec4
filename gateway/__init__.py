"""msggateway: a Twisted protocol gateway for legacy messaging systems.

Layers, bottom up: ``gateway.codecs`` (sans-IO wire formats),
``gateway.protocols`` (thin Twisted adapters), ``gateway.core`` (the canonical
message, outcomes, routing), and the service assembly (``gateway.config``,
``gateway.service``, ``gateway.tls``, ``gateway.admin``, ``gateway.cli``).
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
