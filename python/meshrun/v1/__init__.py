"""Generated gRPC stubs (setup.py writes them at build time)."""
