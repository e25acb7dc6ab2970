"""The model: each architecture family as pure torch over a `KernelSet`, its config, weights and
paged KV cache. Nothing here names a CPU-only path; those live in `graphrt.kernels.cpu`."""

# The KV block padding rows of a micro-batch write to: the block allocator never hands it out.
# Here, not in kv_cache.py, so the allocator and the scheduler can name it without loading torch.
SCRATCH_BLOCK = 0
