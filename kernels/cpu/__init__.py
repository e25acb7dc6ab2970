"""Everything that exists to make the CPU twin fast: matmul forms (packed oneDNN, compiled panels),
compiled ops (csrc/), the one-call decode step, OpenMP thread teams and process placement."""
