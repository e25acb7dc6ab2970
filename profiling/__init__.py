"""NVTX ranges, the timeline recorder and utilization reports (imported as graphrt.profiling)."""
