"""The composition root: builds the parts, wires them, and serves status and commit."""
