"""The trust checks of shardckpt (trust_test.py is their entry point)."""
