"""The server's resources: one module per resource, its service and its queries."""
