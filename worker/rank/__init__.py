"""What every rank process stands on, whatever its form: its context
(`context`), process groups (`rendezvous`), device and backend (`device`) and
RNG state (`rngstate`)."""
