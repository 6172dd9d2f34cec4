"""The admin HTTP endpoint: status page and API, health, metrics, DMP leases and taps.

DESIGN.md, "Operations": a small twisted.web site, meant to listen on
loopback (the assembly chooses the endpoint string). One module per
resource, on a shared base (`gateway.admin.base`):

- `gateway.admin.site`: the site, its index and its resource tree
  (`make_admin_site`, `make_admin_resource`);
- `gateway.admin.channel`: its HTTP channel, which answers only requests
  whose Host names the endpoint and bounds request bodies;
- `gateway.admin.health`: ``/healthz``;
- `gateway.admin.metrics`: ``/metrics``;
- `gateway.admin.status`: the status API, ``/routes``, ``/listeners``,
  ``/upstreams``, ``/streams`` and ``/nodes``;
- `gateway.admin.page`: the status page at ``/`` and its files;
- `gateway.admin.leases`: ``/leases``;
- `gateway.admin.tap`: ``/tap``.

This module imports none of them, so that the configuration can check
host names (`gateway.admin.channel.host_name`) without the site.
"""

__all__: list[str] = []
