"""A rank that does nothing: for capturing torchrun's environment (envdump)."""
