"""A worker process: one device, its runners, its scheduler, and the RPC server gateways talk to."""
