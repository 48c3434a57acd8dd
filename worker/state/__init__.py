"""The sharded state inside a rank: the plan's device mesh (`mesh`), the
sharded model rebuilt per generation (`sharded`), the in-memory reshard
(`reshard`) and peer copies (`peercopy`). It never imports the agent."""
