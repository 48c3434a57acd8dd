"""etcd primitives of a coordinator replica: typed access (`store`), the key
schema (`keys`), leader election and its fencing token (`election`), the one
fenced write path (`writer`), and whether this replica reaches etcd
(`liveness`). They know no job logic, no policy and no gRPC serving."""
