"""Many gateway processes acting as one: the fleet (DESIGN.md, "Scale: a fleet on RabbitMQ").

Every process is a node with an id (`gateway.fleet.node`), configured in
``[fleet] node`` or generated once and kept in its data dir; the id is part
of every publisher reference the process uses towards RabbitMQ, so that two
processes never share one.

Several processes on one host (``[fleet] processes``) run under one
supervisor (`gateway.fleet.supervisor`); each worker (`gateway.fleet.worker`)
is a whole gateway, as node ``<node>-<i>``, whose listeners share their
ports with the other workers' through SO_REUSEPORT (`gateway.fleet.reuseport`).

With ``[fleet] amqp``, each node holds one connection to RabbitMQ (the
backbone, `gateway.fleet.backbone`), over which the SSMP hub crosses nodes
(`gateway.fleet.hub`) and work that must run once per fleet, such as a
consuming upstream, runs on one node at a time under a lock
(`gateway.fleet.locks`). DMP listeners' run-time leases are signed texts
every node checks, revoked through a stream every node replays
(`gateway.fleet.leases`); a feed's reader holds a lock fleet-wide, and
deliveries to it cross nodes (`gateway.fleet.dmp`).
"""
