"""What runs a scheduled step: the pipeline of stages, the ring of micro-batches, the streams
between stages, the sampler with its logprob scoring."""
