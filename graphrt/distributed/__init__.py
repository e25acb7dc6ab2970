"""Stages in processes of their own, on this host or others: the transport, the handshake,
the remote stages rank 0 drives and the worker that runs them."""
