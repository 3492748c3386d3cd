"""Between nodes: the authenticated zmq link, the driver's hub and a member's server."""
