"""The per-key tier's RESP listener (torch's redis-py path): listener, protocol, bounds."""
