"""The ``twistd msggateway`` plugin: names the module that builds the service.

No ``__init__.py`` here or in ``twisted/`` (Twisted's plugin how-to); the
gateway itself is imported only when twistd runs it.
"""

from twisted.application.service import ServiceMaker

msggateway = ServiceMaker(
    "msggateway",
    "gateway.service",
    "A protocol gateway: SSMP, QMQP streaming, DMP, MTL and RabbitMQ streams.",
    "msggateway",
)
