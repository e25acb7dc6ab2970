"""The commands beside serving: bench, doctor, profile, and the synthetic stage they use."""
