"""Receive memory: warm buffers that ring readers and the codec copy large messages into."""
