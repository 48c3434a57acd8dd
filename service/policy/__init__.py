"""The coordinator's pure policies: functions of what the leader read, with no
I/O and no shared state -- the plan (`planner`), the replan decision
(`replan`), the checkpoint interval (`ckptinterval`), the failure stop rule
(`failures`), the stop rules (`stoprules`), the straggler policy
(`stragglers`) and the heartbeat pacing (`pacing`). They import neither etcd
nor the job logic."""
