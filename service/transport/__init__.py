"""How a coordinator replica is served: the gRPC server, its configuration
and its servicers (`server`, `config`, `servicers`), authentication and
leader forwarding (`auth`, `interceptors`, `credentials`, `revocation`), the
streams and heartbeats every replica serves on its loop (`planboard`,
`planstreams`, `heartbeats`, `streamnotes`), health checking (`health`), and
the metrics listener's dashboard and metrics (`dashboard`, `pages`,
`jobmetrics`). The top room: nothing in `service/` imports it."""
