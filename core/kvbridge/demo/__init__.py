"""``kvbridge demo``: a full prefill -> decode run across processes on this host, verified byte for byte."""
