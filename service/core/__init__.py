"""The coordinator's job and membership logic, run by the leader: every change
of a job (`coordinator`, `jobs`, `membership`, `commits`, `fencing`,
`evidence`, `rankpause`, `setaside`), the members' step and start reports
(`reports`), why members went (`departures`), the reconcile loop
(`reconcile`), what the leader keeps in memory per job (`jobstate`) and of
its members' leases (`leases`), and the history in etcd (`history`). Built on `etcd` and `policy`; knows nothing of gRPC serving."""
