"""End to end, across packages: real torch.compile runs (prewarm, verify, the agent, a\nrestored cache that a fresh process hits) and push/pull/prejob against a live server."""
