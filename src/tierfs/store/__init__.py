"""This node's chunk and replica store, and the peer service that serves it."""
