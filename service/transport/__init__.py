"""How a coordinator replica is served: the gRPC server and its servicers
(`server`, `servicers`), authentication and leader forwarding (`interceptors`,
`credentials`, `revocation`), the streams and heartbeats every replica serves
on its loop (`planboard`, `planstreams`, `heartbeats`, `streamnotes`), health
checking (`health`), and the metrics listener's dashboard and metrics
(`dashboard`, `jobmetrics`). The top room: nothing in `service/` imports it."""
