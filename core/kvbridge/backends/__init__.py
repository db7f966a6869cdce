"""Transfer backends shipped with core (``loopback``) and the protocol every backend implements."""
