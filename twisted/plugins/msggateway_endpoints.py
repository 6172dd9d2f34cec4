"""Twisted plugin: msggateway's endpoint string parsers (``mtls:``).

Twisted finds this module because the project root is on ``sys.path`` and
``twisted/plugins`` has no ``__init__.py``. It imports every plugin module
when it meets an endpoint prefix it does not know itself, so this one stays
tiny: `gateway.tls` (and with it cryptography and pyOpenSSL) is imported only
when an ``mtls:`` string is parsed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from twisted.internet.interfaces import IStreamServerEndpointStringParser
from twisted.plugin import IPlugin
from zope.interface import implementer

if TYPE_CHECKING:
    from twisted.internet.interfaces import IReactorCore, IStreamServerEndpoint

__all__ = ["mtls_server_parser"]


@implementer(IPlugin, IStreamServerEndpointStringParser)
class _LazyMTLSServerParser:
    """The ``mtls:`` server endpoint parser; see `gateway.tls` for the syntax."""

    prefix = "mtls"

    def parseStreamServer(
        self, reactor: IReactorCore, *args: object, **kwargs: object
    ) -> IStreamServerEndpoint:
        """Build the endpoint an ``mtls:`` string describes.

        Args:
            reactor: The reactor the endpoint listens with.
            *args: Positional parameters of the string (the port).
            **kwargs: Named parameters of the string.

        Returns:
            What `gateway.tls.MTLSServerParser` builds.
        """
        from gateway.tls import MTLSServerParser  # Lazy: see the module docstring.

        return MTLSServerParser().parseStreamServer(reactor, *args, **kwargs)


mtls_server_parser = _LazyMTLSServerParser()
