"""The model: each architecture family as pure torch over a `KernelSet`, its config, weights and
paged KV cache; the same code on every device, whatever kernels the set holds."""

# The KV block padding rows of a micro-batch write to: the block allocator never hands it out.
# Here, not in kv_cache.py, so the allocator and the scheduler can name it without loading torch.
SCRATCH_BLOCK = 0
